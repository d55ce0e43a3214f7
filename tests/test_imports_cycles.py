"""The package's import graph has no circle, and `import stallfree` and the simulator's commands load no
heavy library (torch, FastAPI, pydantic, matplotlib, numpy)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "stallfree"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(module: str, base: str, level: int) -> str:
    if level == 0:
        return module
    parent = base.split(".")[: len(base.split(".")) - level + (1 if MODULES[base].name == "__init__.py" else 0)]
    return ".".join([*parent, module] if module else parent)


def _imports(name: str) -> set[str]:
    """The stallfree modules `name` imports, at any depth (lazy imports in functions count, and so do
    imports under `if TYPE_CHECKING:`: a circle that only type checking sees is still a circle of the
    design). `from pkg import mod` counts as `pkg.mod`
    when that is a module, else as `pkg`; a module's parent packages are not counted (importing
    `a.b.c` runs `a.b`'s __init__ first, but that is the package's own business)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(node.module or "", name, node.level)
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in MODULES:
                    found.add(sub)
                elif mod in MODULES:
                    found.add(mod)
        stack.extend(ast.iter_child_nodes(node))
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_circle():
    """The cycle finder reports a -> b -> c -> a and nothing for a chain."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_in_the_package():
    """No two stallfree modules import each other, directly or through others (lazy and TYPE_CHECKING
    imports included)."""
    graph = {name: _imports(name) for name in MODULES}
    assert _cycles(graph) == []


def _loaded(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nprint(','.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(SRC)},
    )
    return {m.split(".")[0] for m in out.stdout.strip().split(",")}


HEAVY = {"torch", "fastapi", "pydantic", "starlette", "uvicorn", "matplotlib", "numpy", "rich"}


def test_import_stallfree_loads_no_heavy_library():
    """`import stallfree` loads none of torch, FastAPI, pydantic, matplotlib, numpy or rich."""
    assert _loaded("import sys, stallfree") & HEAVY == set()


def test_simulate_help_loads_no_heavy_library():
    """Building the parser for `stallfree simulate` (what `simulate --help` does) loads no heavy library,
    and no module of the engine or the server."""
    code = "import sys\nfrom stallfree.cli import build_parser\nbuild_parser('simulate')"
    loaded = _loaded(code)
    assert loaded & HEAVY == set()
    full = subprocess.run(
        [sys.executable, "-c", code + "\nprint(','.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, env={"PYTHONPATH": str(SRC)},
    ).stdout
    assert "stallfree.server" not in full and "stallfree.engine" not in full


def test_full_parser_loads_no_web_framework():
    """Registering every command (`stallfree --help`) does not import FastAPI or torch."""
    assert _loaded("import sys\nfrom stallfree.cli import build_parser\nbuild_parser()") & {"torch", "fastapi"} == set()


def test_top_level_help_lists_every_command(capsys):
    """Registering only the named command's module never hides the others from `stallfree --help`."""
    import pytest

    from stallfree.cli import main

    for argv in (["--help"], ["--help", "simulate"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        for command in ("budget", "simulate", "sweep", "tune", "generate", "serve", "demo"):
            assert command in out, (argv, command)
