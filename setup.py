"""Only what pyproject.toml cannot say: the wheel carries the top-level csrc/ inside the package
(torchtitan_megamoe/csrc/), where ops/hopper/cuda/build.py looks when there is no checkout."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        src = Path(__file__).resolve().parent / "csrc"
        dst = Path(self.build_lib) / "torchtitan_megamoe" / "csrc"
        dst.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.glob("*.cu*")):
            shutil.copy2(f, dst / f.name)


setup(cmdclass={"build_py": BuildPyWithCsrc})
