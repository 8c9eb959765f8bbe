"""Only what pyproject.toml cannot say: the wheel carries the top-level csrc/ (with its include/
subfolder) inside the package (torchtitan_megamoe/csrc/), where ops/hopper/cuda/build.py looks
when there is no checkout."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CUDA_SOURCES = (".cu", ".cuh", ".h")


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        src = Path(__file__).resolve().parent / "csrc"
        dst = Path(self.build_lib) / "torchtitan_megamoe" / "csrc"
        for f in sorted(src.rglob("*")):
            if f.is_file() and f.suffix in CUDA_SOURCES:
                target = dst / f.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)


setup(cmdclass={"build_py": BuildPyWithCsrc})
