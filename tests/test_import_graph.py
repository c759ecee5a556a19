"""The import graph of clawd/ (and tui/), read statically with `ast`: no import cycle, and the
import contracts of DESIGN.md hold transitively. tests/test_boundaries.py proves the same
contracts at runtime (sys.modules); this file also sees the imports inside functions, which a
runtime probe only sees when that function runs.

How the graph is read (decisions a reader may question):
- Every `import` / `from ... import`, at module level and inside functions; relative imports
  resolved against the importing module's package. `if TYPE_CHECKING:` imports count too:
  a type-only dependency is still a dependency between rooms.
- `clawd/x/__init__.py` is module `clawd.x`. `from pkg import name` imports `pkg.name` when
  that is a module here, else `pkg` itself (`name` is an attribute of its __init__).
- Importing `clawd.a.b` runs `clawd/a/__init__.py` first, so it is an edge to `clawd.a` too,
  unless `clawd.a` is a package the importer itself lives in: that package was initialised
  before the importer could run, so the edge adds no ordering and would make every package
  whose __init__ re-exports a submodule look circular.
- Dynamic imports (importlib.import_module, __import__) are not followed; clawd uses them
  only for third-party modules (mlx_lm.models.*, HTTP clients).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from tests.conftest import ROOT


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under root/<package>."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return name in files and files[name].name == "__init__.py"


def _resolve_relative(module: str, level: int, target: str | None, files: dict[str, Path]) -> str:
    base = module.split(".") if _is_package(module, files) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, files: dict[str, Path]) -> set[str]:
    """Every module `module` names in an import statement (see the module docstring)."""
    tree = ast.parse(files[module].read_text(encoding="utf-8"), filename=str(files[module]))
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, node.level, node.module, files) if node.level else node.module
            if base == "__future__":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                named.add(sub if sub in files else base)
    out = set()
    for name in named:
        out.add(name)
        parts = name.split(".")
        for i in range(1, len(parts)):  # the packages whose __init__ runs first
            parent = ".".join(parts[:i])
            if parent in files and not module.startswith(parent + "."):
                out.add(parent)
    out.discard(module)
    return out


def import_graph(root: Path = ROOT, packages: Iterable[str] = ("clawd", "tui")) -> dict[str, set[str]]:
    """Module -> the modules it imports. Third-party modules appear as targets only."""
    files = module_files(root, packages)
    return {m: imports_of(m, files) for m in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue  # third-party: imports nothing of ours
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(
    graph: dict[str, set[str]], start: Iterable[str], *, skip: set[tuple[str, str]] = frozenset()
) -> dict[str, str]:
    """Every module reachable from `start` -> the module that imports it on one path there
    (to name the chain in a failure). `skip` holds (importer, imported-prefix) edges to ignore."""
    via: dict[str, str] = {}
    todo = list(start)
    seen = set(todo)
    while todo:
        v = todo.pop()
        for w in sorted(graph.get(v, ())):
            if any(v == a and (w == b or w.startswith(b + ".")) for a, b in skip) or w in seen:
                continue
            seen.add(w)
            via[w] = v
            todo.append(w)
    return via


def chain(via: dict[str, str], end: str) -> str:
    path = [end]
    while path[-1] in via:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


def _hits(via: dict[str, str], forbidden: Iterable[str]) -> list[str]:
    return [chain(via, m) for m in sorted(via) if any(m == f or m.startswith(f + ".") for f in forbidden)]


GRAPH = import_graph()


def _under(prefix: str) -> list[str]:
    return [m for m in GRAPH if m == prefix or m.startswith(prefix + ".")]


# ---- no cycles --------------------------------------------------------------------------------


def test_the_walker_reports_a_cycle(tmp_path):
    # A walker that never fails proves nothing: two modules importing each other, one of them
    # inside a function and relatively, must come out as one cycle.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_clawd_has_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles (each: modules that import each other, directly or not):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


# ---- contracts (DESIGN.md), transitively ---------------------------------------------------------


def test_clawd_never_reaches_the_tui_or_textual():
    # `clawd chat` (cli.cmd_chat) is the one edge that opens the TUI, lazily, at the CLI's edge.
    via = reachable(GRAPH, _under("clawd"), skip={("clawd.cli", "tui")})
    assert _hits(via, ["tui", "textual"]) == []


def test_tui_never_reaches_engines_or_heavy_libraries():
    # The TUI talks to the daemon over HTTP only.
    via = reachable(GRAPH, _under("tui"))
    assert _hits(via, ["mlx", "mlx_lm", "llama_cpp", "clawd.engines"]) == []


def test_store_and_engines_do_not_reach_each_other():
    assert _hits(reachable(GRAPH, _under("clawd.store")), ["clawd.engines"]) == []
    assert _hits(reachable(GRAPH, _under("clawd.engines")), ["clawd.store"]) == []


def test_modelfile_is_the_ground_floor():
    # Everything that reads model headers imports clawd.modelfile; it importing them back
    # would bring the old circles back.
    assert {m for m in GRAPH["clawd.modelfile"] if m.startswith("clawd")} <= {"clawd.errors"}


def test_trainer_child_does_not_reach_the_daemon():
    # The trainer child process only trains; storage, chat and mining stay in the daemon.
    via = reachable(GRAPH, ["clawd.training.run"])
    assert _hits(via, ["clawd.store", "clawd.chat", "clawd.miner", "aiosqlite"]) == []
