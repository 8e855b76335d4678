"""The layers of docs/design.md call only downward, read from the source's imports (AST).

    fasttrans.nn -> fasttrans.functional -> fasttrans.backends -> kernels / extension / reference

A module may import its own layer and the layers below it; the core chain (nn, functional,
backends) may not skip a layer; the bottom layer's parts (the Triton kernels, the C++/CUDA
extension, the reference) do not import each other, only the neutral modules below them;
no import cycle; and no layer uses another layer's private names (``_name``, or a module
whose own name starts with ``_``). Function-level imports count like module-level ones.

KNOWN lists the violations the code still has, each with what removes it; the test fails on
any violation not listed, and on a listed one that is gone (so the list only shrinks). The
last tests show that the checker finds each kind of violation.

The tests themselves may use a private name of the package only where docs/design.md lists
it under "Internal entry points the tests use", and that list names only what they use.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (module prefix, layer, group): higher layers sit above lower ones; a group is one part of
# a layer (the bottom layer's parts must not import each other). Longest prefix wins.
LAYERS = [
    ("fasttrans.dropout_spec", 0, "neutral"),
    ("fasttrans.version", 0, "neutral"),
    ("fasttrans.environ", 0, "neutral"),
    ("fasttrans.reference", 1, "reference"),
    ("fasttrans.kernels", 1, "kernels"),
    ("fasttrans.extension", 1, "extension"),
    ("fasttrans.csrc", 1, "extension"),
    ("fasttrans.backends", 2, "backends"),
    ("fasttrans.functional", 3, "functional"),
    ("fasttrans.nn", 4, "nn"),
    ("fasttrans.conversion", 5, "conversion"),
    ("fasttrans.models", 5, "models"),
    ("fasttrans.tasks", 6, "tasks"),
    ("fasttrans.integrations", 6, "integrations"),  # other libraries' models on fasttrans (conversion, nn)
    ("fasttrans.train", 6, "train"),
    ("fasttrans.compile_check", 7, "tools"),
    ("fasttrans.cli", 7, "tools"),
    ("fasttrans.__main__", 7, "tools"),
    ("fasttrans", 7, "package"),  # fasttrans/__init__.py: re-exports for users
]
CORE = {"backends", "functional", "nn"}  # the chain that may not skip a layer

# Violations still in the code: (kind, importer, imported) -> what removes it.
KNOWN: dict[tuple[str, str, str], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module, or module.name for a name imported from a module
    module: str  # the module the target lives in
    private: bool


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":  # installed as fasttrans.kernels (setup.py's package_dir)
        parts[0:1] = ["fasttrans", "kernels"]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def classify(module: str, layers=LAYERS) -> tuple[int, str] | None:
    best = None
    for prefix, layer, group in layers:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer, group)
    return None if best is None else (best[1], best[2])


def read_imports(path: Path, name: str, modules: set[str]) -> list[Import]:
    """Every import of a package module in one file, and every private attribute read
    through a name bound to one (``FT._attention`` after ``import ... functional as FT``)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    bound: dict[str, str] = {}  # local name -> module it refers to

    def add(target: str, module: str, private: bool):
        if module in modules:
            found.append(Import(name, target, module, private))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, alias.name, any(p.startswith("_") and p != "__main__" for p in alias.name.split(".")))
                if alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:  # a submodule: an import of that module
                    add(sub, sub, alias.name.startswith("_"))
                    bound[alias.asname or alias.name] = sub
                else:
                    add(sub, source, alias.name.startswith("_") and not alias.name.startswith("__"))
    def resolve(node) -> str | None:  # the module a name or a dotted chain of submodules refers to
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = resolve(node.value)
            if base is not None and f"{base}.{node.attr}" in modules:
                return f"{base}.{node.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            module = resolve(node.value)
            if module is not None:
                add(f"{module}.{node.attr}", module, True)
    return found


def package_files(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for d in ("fasttrans", "kernels") for p in (root / d).rglob("*.py")}


def violations(root: Path, layers=LAYERS, core=CORE) -> set[tuple[str, str, str]]:
    files = package_files(root)
    modules = set(files)
    found: set[tuple[str, str, str]] = set()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in files.items():
        src = classify(name, layers)
        for imp in read_imports(path, name, modules):
            if imp.module == name:
                continue
            graph[name].add(imp.module)
            dst = classify(imp.module, layers)
            if src is None or dst is None:
                continue
            (ls, gs), (ld, gd) = src, dst
            if ld > ls:
                found.add(("imports upward", name, imp.module))
            elif gs in core and ld < ls - 1 and ld > 0:
                found.add(("skips a layer", name, imp.module))
            elif ls == ld == 1 and gs != gd:
                found.add(("bottom parts import each other", name, imp.module))
            if imp.private and gs != gd:
                found.add(("private name", name, imp.target))
    for a, b in _cycle_edges(graph):
        found.add(("cycle", *sorted((a, b))))
    return found


def _cycle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Edges a -> b inside one strongly connected component of more than one module,
    ignoring a package's imports of its own submodules (the re-exports of an __init__)."""
    edges = {a: {b for b in bs if not b.startswith(a + ".")} for a, bs in graph.items()}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {m: reach(m) for m in edges}
    return {(a, b) for a in edges for b in edges[a] if a in reachable.get(b, ())}


def test_layers_call_only_downward():
    found = violations(ROOT)
    new = sorted(found - KNOWN.keys())
    gone = sorted(KNOWN.keys() - found)
    assert not new, "imports against docs/design.md's layers:\n" + "\n".join(map(str, new))
    assert not gone, "fixed, so remove from KNOWN:\n" + "\n".join(map(str, gone))


# ---------------------------------------------------------------------------------------
# the tests' own reach into the package
# ---------------------------------------------------------------------------------------
INTERNALS_HEADING = "## Internal entry points the tests use"


def private_names_in_tests(root: Path) -> dict[str, set[str]]:
    """Private names of the package (``module._name``, or a private module) that tests/*.py
    use -> the test files that use them."""
    modules = set(package_files(root))
    used: dict[str, set[str]] = {}
    for path in sorted((root / "tests").glob("*.py")):
        for imp in read_imports(path, f"tests.{path.stem}", modules):
            if imp.private:
                used.setdefault(imp.target, set()).add(path.name)
    return used


def documented_internals(design: str) -> set[str]:
    """The backticked dotted names listed under INTERNALS_HEADING in docs/design.md."""
    section = design.split(INTERNALS_HEADING, 1)[1].split("\n## ", 1)[0]
    return {name for name in re.findall(r"`([\w.]+)`", section) if name.startswith("fasttrans.")}


def test_tests_use_only_documented_internals():
    used = private_names_in_tests(ROOT)
    design = (ROOT / "docs" / "design.md").read_text()
    assert INTERNALS_HEADING in design
    listed = documented_internals(design)
    missing = sorted(f"{name} ({', '.join(sorted(files))})" for name, files in used.items() if name not in listed)
    stale = sorted(listed - used.keys())
    assert not missing, f"private names the tests use, not listed under {INTERNALS_HEADING!r} in docs/design.md:\n" \
        + "\n".join(missing)
    assert not stale, "listed in docs/design.md but used by no test, so remove:\n" + "\n".join(stale)


def test_internals_checker_finds_private_names(tmp_path):
    root = _toy(tmp_path, {
        "fasttrans/backends/__init__.py": "from . import registry\n",
        "fasttrans/backends/registry.py": "def _preference():\n    pass\n",
        "fasttrans/functional.py": "from . import backends\ndef _draw_seed():\n    pass\n",
        "kernels/_launch.py": "",
        "tests/test_a.py": "from fasttrans import backends, functional\nimport fasttrans.functional as F\n"
                           "backends.registry._preference()\nF._draw_seed()\nfunctional.attention\n",
        "tests/test_b.py": "from fasttrans.kernels import _launch as launch\n"
                           "from fasttrans.functional import _draw_seed\n",
    })
    (root / "fasttrans" / "backends.py").unlink()
    assert private_names_in_tests(root) == {
        "fasttrans.backends.registry._preference": {"test_a.py"},
        "fasttrans.functional._draw_seed": {"test_a.py", "test_b.py"},
        "fasttrans.kernels._launch": {"test_b.py"},
    }
    design = f"# x\n{INTERNALS_HEADING}\n- `fasttrans.functional._draw_seed`: why\n## Next\n- `fasttrans.other._x`\n"
    assert documented_internals(design) == {"fasttrans.functional._draw_seed"}


# ---------------------------------------------------------------------------------------
# the checker itself, on a small package laid out like the real one
# ---------------------------------------------------------------------------------------
_TOY_LAYERS = [("fasttrans.reference", 1, "reference"), ("fasttrans.kernels", 1, "kernels"),
               ("fasttrans.backends", 2, "backends"), ("fasttrans.functional", 3, "functional"),
               ("fasttrans.nn", 4, "nn"), ("fasttrans", 7, "package")]


def _toy(tmp_path: Path, files: dict[str, str]) -> Path:
    base = {
        "fasttrans/__init__.py": "from . import nn\n",
        "fasttrans/reference.py": "",
        "fasttrans/backends.py": "from fasttrans import reference\n",
        "fasttrans/functional.py": "from . import backends\n",
        "fasttrans/nn/__init__.py": "from .attention import f\n",
        "fasttrans/nn/attention.py": "from .. import functional as FT\ndef f():\n    return FT.attention\n",
        "kernels/__init__.py": "",
        "kernels/attention.py": "",
    }
    base.update(files)
    for rel, text in base.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path


def test_checker_accepts_a_clean_package(tmp_path):
    assert violations(_toy(tmp_path, {}), _TOY_LAYERS) == set()


@pytest.mark.parametrize("files, expected", [
    ({"fasttrans/backends.py": "from fasttrans import functional\n"},
     ("imports upward", "fasttrans.backends", "fasttrans.functional")),
    ({"fasttrans/nn/attention.py": "def f():\n    from fasttrans import backends\n"},
     ("skips a layer", "fasttrans.nn.attention", "fasttrans.backends")),
    ({"kernels/attention.py": "from fasttrans.reference import threshold\n"},
     ("bottom parts import each other", "fasttrans.kernels.attention", "fasttrans.reference")),
    ({"fasttrans/nn/attention.py": "from .. import functional as FT\ndef f():\n    return FT._attention\n"},
     ("private name", "fasttrans.nn.attention", "fasttrans.functional._attention")),
    ({"fasttrans/nn/attention.py": "from fasttrans.functional import _check\n"},
     ("private name", "fasttrans.nn.attention", "fasttrans.functional._check")),
    ({"fasttrans/nn/attention.py": "from . import _masks\n", "fasttrans/nn/_masks.py": "from . import attention\n"},
     ("cycle", "fasttrans.nn._masks", "fasttrans.nn.attention")),
], ids=["upward", "skip", "bottom", "private-attribute", "private-import", "cycle"])
def test_checker_finds_each_kind_of_violation(tmp_path, files, expected):
    assert expected in violations(_toy(tmp_path, files), _TOY_LAYERS)
