"""House rules that a review would otherwise have to catch (CPU, no imports of the package).

- No import cycles among torchtitan_megamoe's modules: every import statement counts, at module
  level or inside a function (a deferred import hides a cycle, it does not remove it); imports
  under ``if TYPE_CHECKING:`` never run and do not count. A cycle is a strongly connected
  component of more than one module in the import graph.
- ops/hopper/kernels/ holds Triton kernels and their plain launchers only: none of its modules
  reaches the CUDA wrappers (ops/hopper/cuda/), DeepGEMM (ops/hopper/deepgemm.py) or the stage
  tables that choose between them (ops/hopper/sides/), directly or through other modules.
- Code comments and docstrings under torchtitan_megamoe/ops/ and csrc/ say why, not when: no
  dates, no commit hashes, no pointers to docs/PERF.md (history lives there and in git).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "torchtitan_megamoe"
PKG_DIR = REPO / PACKAGE

# --------------------------------------------------------------------------------------------
# Import graph


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG_DIR.rglob("*.py"))
            if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom in ``tree`` (any depth), less those under TYPE_CHECKING."""
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                todo.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            todo.append(child)


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``name`` (at ``path``) imports: for ``from X import y`` the
    submodule X.y where it is one, else X."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        for t in targets:
            # `import a.b.c` names a.b.c; keep the longest prefix that is a module of ours
            parts = t.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != name:
                out.add(".".join(parts))
    return out


def import_graph() -> dict[str, set[str]]:
    mods = package_modules()
    names = set(mods)
    return {n: imports_of(n, p, names) for n, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def test_cycle_finder_on_small_graphs():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}) == [["a", "b", "c"]]


def test_import_parser_sees_deferred_relative_and_submodule_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import torchtitan_megamoe.ops.api as api\n"
        "from . import sibling\n"
        "from .pkg import helper\n"
        "if TYPE_CHECKING:\n"
        "    from torchtitan_megamoe import hidden\n"
        "def f():\n"
        "    from torchtitan_megamoe.pkg import name_in_init\n"
    )
    mods = {"torchtitan_megamoe", "torchtitan_megamoe.ops", "torchtitan_megamoe.ops.api",
            "torchtitan_megamoe.sibling", "torchtitan_megamoe.pkg",
            "torchtitan_megamoe.pkg.helper", "torchtitan_megamoe.hidden",
            "torchtitan_megamoe.m"}
    assert imports_of("torchtitan_megamoe.m", src, mods) == {
        "torchtitan_megamoe.ops.api", "torchtitan_megamoe.sibling",
        "torchtitan_megamoe.pkg.helper", "torchtitan_megamoe.pkg"}


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "torchtitan_megamoe.ops.api" in graph and graph["torchtitan_megamoe.moe"]
    found = cycles(graph)
    detail = "\n".join(
        " <-> ".join(c) + "\n" + "".join(
            f"    {a} imports {', '.join(sorted(graph[a] & set(c)))}\n" for a in c)
        for c in found)
    assert not found, f"import cycles:\n{detail}"


HOPPER = f"{PACKAGE}.ops.hopper"
NOT_FOR_KERNELS = (f"{HOPPER}.cuda", f"{HOPPER}.deepgemm", f"{HOPPER}.sides")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_kernels_import_neither_cuda_nor_deepgemm():
    graph = import_graph()
    kernels = [m for m in graph if m.startswith(f"{HOPPER}.kernels.")]
    assert f"{HOPPER}.kernels.gemm1_swiglu" in kernels
    bad = {m: sorted(r for r in reachable(graph, m)
                     if any(r == n or r.startswith(n + ".") for n in NOT_FOR_KERNELS))
           for m in kernels}
    bad = {m: r for m, r in bad.items() if r}
    assert not bad, f"kernels/ modules that reach the CUDA or DeepGEMM sides: {bad}"


# --------------------------------------------------------------------------------------------
# Comments and docstrings

DATE = re.compile(r"\b20[2-3]\d-[01]\d(?:-[0-3]\d)?\b")
PERF_POINTER = re.compile(r"PERF\.md", re.IGNORECASE)
# A git hash: 7-40 lowercase hex digits with at least one digit and one letter (so neither a
# word like "deadbeef" nor a decimal number), not part of a longer word or a 0x constant, and
# next to what names a commit: a word such as "commit", "at", "since", "in", a parenthesis or
# bracket, list punctuation, an arrow between two of them, or the start of the comment line.
_HEX = r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}"
_H = rf"(?<![0-9A-Za-z_.]){_HEX}(?![0-9A-Za-z_])"
_BEFORE = (r"(?:(?:^|[\s(\[;,])(?:commits?|at|since|in|see|from|before|after|show|and|or|by"
           r"|to|until)\s+|^[\s#/*]*|[(\[]\s*|[;,]\s+|(?:->|→)\s*)")
_AFTER = r"(?=\s*(?:[)\].;,:~^]|->|→))"
COMMIT = re.compile(rf"{_BEFORE}{_H}|{_H}{_AFTER}")

COMMENT_RULES = (("date", DATE), ("PERF.md pointer", PERF_POINTER), ("commit hash", COMMIT))


def python_comments(text: str):
    """(line, text) of every comment and docstring-like string statement in Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            for k, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + k, line


def c_comments(text: str):
    """(line, text) of every // and /* */ comment in C/C++/CUDA source (string and character
    literals skipped)."""
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            yield line, text[i:j]
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k, part in enumerate(text[i:j].split("\n")):
                yield line + k, part
            line += text.count("\n", i, j)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1


def comment_findings(path: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, rule, matched text) of every comment or docstring line breaking a rule."""
    text = path.read_text()
    lines = python_comments(text) if path.suffix == ".py" else c_comments(text)
    name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    return [(name, n, what, m.group(0).strip()) for n, c in lines
            for what, rx in COMMENT_RULES if (m := rx.search(c))]


def test_comment_rules_on_examples():
    def hits(s):
        return [what for what, rx in COMMENT_RULES if rx.search(s)]

    assert hits("# measured 2026-12-02 on an H200") == ["date"]
    assert hits("# see docs/PERF.md, Training A/Bs") == ["PERF.md pointer"]
    for s in ("# default since 7a9c84f", "# (commit 4c3ef87)", "# at 5e0bafa the tile",
              "# 8cbb2f6 → 15d85ff", "# built in d704abc (offline)", "# e77b11b)",
              "# 5e0bafa; what runs", "// rejected; 96ffb6b.", "tile (42220ae, reverted"):
        assert hits(s) == ["commit hash"], s
    for s in ("# mask 0x7fffffff and 0xdeadbeef1", "# e4m3 max 448, 1e-5 tolerance",
              "# 128x128 blocks, m64n256k16 wgmma", "# the deadbeef pattern (cafebabe)",
              "# (12345678 rows)", "# sm_90a, 4294967295", "# blockDim 256 (warpgroup 2)",
              "# 2026 was a year", "# 0x1234abcd, 0xffffffff; 0xdeadbeef.",
              "# fp8e4m3 and m64n256k16 (sm_90a)", "# 12582912, 3145728."):
        assert hits(s) == [], s


def test_comment_scanners_find_only_comments(tmp_path):
    py = tmp_path / "a.py"
    py.write_text('"""Doc at e77b11b."""\nX = "2026-12-02"  # since 7a9c84f\n'
                  'def f():\n    """See docs/PERF.md."""\n')
    assert sorted((n, what) for _, n, what, _ in comment_findings(py)) == [
        (1, "commit hash"), (2, "commit hash"), (4, "PERF.md pointer")]
    cu = tmp_path / "k.cu"
    cu.write_text('const char* s = "// 2026-12-02";\n/* tile order\n   since 0c1db9f */\n'
                  "int x = 0x7fffffff; // (2026-11-30)\n")
    assert [(n, what) for _, n, what, _ in comment_findings(cu)] == [
        (3, "commit hash"), (4, "date")]


SCANNED = ("torchtitan_megamoe/ops", "csrc")
SUFFIXES = {".py", ".cu", ".cuh", ".h", ".hpp", ".cpp", ".cc"}


@pytest.mark.parametrize("root", SCANNED)
def test_no_dates_hashes_or_perf_pointers_in_comments(root):
    files = [p for p in sorted((REPO / root).rglob("*")) if p.suffix in SUFFIXES
             and "__pycache__" not in p.parts]
    assert files, f"nothing to scan under {root}"
    found = [f"{f}:{n}: {what} {text!r}" for p in files for f, n, what, text in comment_findings(p)]
    assert not found, f"{len(found)} comments to rewrite (say why, not when):\n" + "\n".join(found)
