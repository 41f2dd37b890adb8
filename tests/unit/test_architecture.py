"""The package's floors, as ARCHITECTURE.md draws them, held against its imports.

* no import cycle between kvpersist's modules (every import counts, also one inside a
  function: it runs, only later);
* no import from a lower floor to a higher one;
* an import of a kvpersist module inside a function, outside ``cli.py`` and ``commands/``,
  says why it is lazy (``# lazy: <reason>`` on its line or the line above);
* every module is at most 600 lines, except the pure data tables ARCHITECTURE.md names.
* a module or sub-package name stands in at most one of stack/, l2/, config/, system/.

The floors are read from ARCHITECTURE.md's table, so the document and this test cannot drift.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..conftest import REPO

PACKAGE = REPO / "kvpersist"
DOC = REPO / "ARCHITECTURE.md"
MAX_LINES = 600
#: a floor row of ARCHITECTURE.md: ``| 7 | `cli.py`, `commands/` | ... |``
FLOOR_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")
ROOM = re.compile(r"`([a-z0-9_]+(?:/|\.py))`")
#: where ARCHITECTURE.md lists the modules that are data tables (exempt from MAX_LINES)
DATA_TABLE = re.compile(r"^- data table: `kvpersist/([a-z0-9_/]+\.py)`", re.M)


def floors() -> dict[str, int]:
    """Room (``commands/``, ``cli.py``) -> floor number, from ARCHITECTURE.md."""
    out: dict[str, int] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = FLOOR_ROW.match(line)
        if m:
            for room in ROOM.findall(m.group(2)):
                out[room] = int(m.group(1))
    return out


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str, rooms: dict[str, int]) -> str:
    """The room a module stands in: its sub-package (``stack/``) or its own file (``cli.py``);
    the package's face (``kvpersist/__init__.py``) is ``__init__.py``."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if len(parts) > 1 or f"{parts[0]}/" in rooms:
        return f"{parts[0]}/"
    return f"{parts[0]}.py"


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    #: inside a function (not at module level, not under ``if TYPE_CHECKING:``)
    nested: bool


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if MODULES[importer].name != "__init__.py":
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _targets(importer: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    mod = _resolve(importer, node)
    for alias in node.names:
        if f"{mod}.{alias.name}" in MODULES:
            yield f"{mod}.{alias.name}"
        elif mod in MODULES:
            yield mod


def _walk(tree: ast.AST, nested: bool = False,
          typing_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, nested, typing_only
        inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        guard = typing_only or (isinstance(child, ast.If)
                                and "TYPE_CHECKING" in ast.unparse(child.test))
        yield from _walk(child, inner, guard)


def edges() -> list[Edge]:
    out = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node, nested, typing_only in _walk(tree):
            for target in _targets(name, node):
                if target != name and not typing_only:
                    out.append(Edge(name, target, node.lineno, nested))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_document_names_every_room_once() -> None:
    rooms = floors()
    assert rooms, "ARCHITECTURE.md has no floor table"
    actual = {room_of(m, rooms) for m in MODULES}
    assert actual <= set(rooms), f"rooms without a floor in ARCHITECTURE.md: {actual - set(rooms)}"
    assert set(rooms) <= actual, f"floors name rooms that do not exist: {set(rooms) - actual}"


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for e in edges():
        graph.setdefault(e.importer, set()).add(e.imported)
    assert cycles(graph) == []


def test_no_import_runs_up_a_floor() -> None:
    rooms = floors()
    upward = []
    for e in edges():
        a, b = room_of(e.importer, rooms), room_of(e.imported, rooms)
        if rooms[a] < rooms[b]:
            upward.append(f"{e.importer}:{e.line} (floor {rooms[a]}) imports {e.imported} "
                          f"(floor {rooms[b]})")
    assert upward == []


def test_every_lazy_import_says_why() -> None:
    rooms = floors()
    silent = []
    for e in edges():
        if not e.nested or room_of(e.importer, rooms) in ("cli.py", "commands/"):
            continue
        lines = MODULES[e.importer].read_text(encoding="utf-8").splitlines()
        here = lines[e.line - 1]
        above = lines[e.line - 2] if e.line > 1 else ""
        if "# lazy:" not in here and "# lazy:" not in above:
            silent.append(f"{e.importer}:{e.line} imports {e.imported}")
    assert silent == [], "imports inside functions without a '# lazy: <reason>' comment"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name: str) -> None:
    tables = set(DATA_TABLE.findall(DOC.read_text(encoding="utf-8")))
    path = MODULES[name]
    n = len(path.read_text(encoding="utf-8").splitlines())
    rel = str(path.relative_to(PACKAGE))
    if rel in tables:
        return
    assert n <= MAX_LINES, f"{rel} has {n} lines (at most {MAX_LINES}, or a data table)"


def test_the_checker_sees_what_it_must() -> None:
    """The graph is not empty, and a known nested import and a known edge are found (a broken
    parser would pass every test above)."""
    found = edges()
    assert len(found) > 100
    assert any(e.importer == "kvpersist.cli" and e.imported == "kvpersist.errors" for e in found)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# --------------------------------------------------------------------------- actions and I/O

#: ``- composition: `actions/a.py` uses `actions/b.py`, `actions/c.py` (why)``
COMPOSITION = re.compile(r"^- composition: `(actions/[a-z_]+\.py)` uses (.*)$", re.M)
#: ``- I/O: `module` only in `system/a.py`, `system/b.py```
IO_RULE = re.compile(r"^- I/O: `([a-z_.]+)` only in (.*)$", re.M)
PATHS = re.compile(r"`([a-z0-9_/]+\.py)`")


def _module_of(rel: str) -> str:
    return "kvpersist." + rel.removesuffix(".py").replace("/", ".")


def test_actions_call_only_the_compositions_listed() -> None:
    """``actions/`` never calls another action but as ARCHITECTURE.md's list says (each
    composition names exactly the actions it uses)."""
    listed = {_module_of(a): {_module_of(p) for p in PATHS.findall(uses)}
              for a, uses in COMPOSITION.findall(DOC.read_text(encoding="utf-8"))}
    assert listed, "ARCHITECTURE.md lists no composition"
    actual: dict[str, set[str]] = {}
    for e in edges():
        if e.importer.startswith("kvpersist.actions.") and \
                e.imported.startswith("kvpersist.actions."):
            actual.setdefault(e.importer, set()).add(e.imported)
    assert actual == listed, (f"actions importing actions: {actual}; ARCHITECTURE.md lists: "
                              f"{listed}")


def _imported_names(path: Path) -> Iterator[tuple[str, int]]:
    """Every name a module imports, fully qualified (``a.b`` and ``a.b.c`` for ``from a.b
    import c``), with its line; relative imports resolved."""
    name = module_name(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, node) if node.level else (node.module or "")
            yield mod, node.lineno
            for alias in node.names:
                yield f"{mod}.{alias.name}", node.lineno


def test_io_happens_only_where_the_document_says() -> None:
    """HTTP to the servers through the clients, processes through system/procs.py (the
    lines of ARCHITECTURE.md's "Where I/O happens")."""
    rules = {mod: {_module_of("system/" + p.split("system/", 1)[1]) for p in PATHS.findall(where)}
             for mod, where in IO_RULE.findall(DOC.read_text(encoding="utf-8"))}
    assert {"requests", "subprocess", "psutil"} <= set(rules), rules
    wrong = []
    for name, path in MODULES.items():
        for imported, line in _imported_names(path):
            for mod, allowed in rules.items():
                if (imported == mod or imported.startswith(mod + ".")) and \
                        name not in allowed and name != mod.rpartition(".")[0]:
                    wrong.append(f"{name}:{line} imports {imported} (only "
                                 f"{', '.join(sorted(allowed))} may)")
    assert wrong == []


#: the floors whose module names must be unique among them (a command and its action may
#: share a name: they stand on floors 7 and 6)
UNIQUE_ACROSS = ("stack", "l2", "config", "system")


def test_no_module_name_stands_in_two_of_the_lower_floors() -> None:
    """A module or sub-package name (``plan``, ``keys``, ``forget``) exists in at most one of
    ``stack/``, ``l2/``, ``config/`` and ``system/``, at any depth: a name says which floor
    it is on."""
    where: dict[str, set[str]] = {}
    for name in MODULES:
        parts = name.split(".")
        if len(parts) < 3 or parts[1] not in UNIQUE_ACROSS:
            continue
        for part in parts[2:]:
            where.setdefault(part, set()).add(parts[1])
    assert {n: sorted(f) for n, f in where.items() if len(f) > 1} == {}


# --------------------------------------------------------------------------- the deployment

#: ``- whole deployment only in `stack/launch_plan.py`, `stack/locate.py`, ...``
WHOLE_DEPLOYMENT = re.compile(r"^- whole deployment only in (.*)$", re.M)
DEPLOYMENT_TYPE = re.compile(r"\bDeployment\b")
#: a launch's steps after its plan: they take the plan's parts
LAUNCH_STEPS = ("kvpersist.stack.launch", "kvpersist.stack.preflight",
                "kvpersist.stack.identity_check", "kvpersist.stack.vllm_args",
                "kvpersist.stack.processes", "kvpersist.stack.crash_window",
                "kvpersist.stack.warm.prime", "kvpersist.stack.canary.")


def _takes_deployment(path: Path) -> list[str]:
    """Where a module takes a whole ``Deployment``: each parameter or annotated field whose
    type names it (``Deployment``, ``Deployment | None``, ``list[Deployment]``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None and \
                        DEPLOYMENT_TYPE.search(ast.unparse(arg.annotation)):
                    out.append(f"{node.name}({arg.arg})")
        elif isinstance(node, ast.AnnAssign) and DEPLOYMENT_TYPE.search(
                ast.unparse(node.annotation)):
            out.append(f"field {ast.unparse(node.target)}")
    return out


def test_the_whole_deployment_is_taken_only_where_the_document_says() -> None:
    """A config is read once and planned once: only the modules ARCHITECTURE.md lists take a
    whole ``Deployment`` (a parameter or a field); a launch's steps take the plan's parts.
    Held both ways, so the list cannot go stale."""
    lines = WHOLE_DEPLOYMENT.findall(DOC.read_text(encoding="utf-8"))
    assert len(lines) == 1, "ARCHITECTURE.md has no (or more than one) whole-deployment line"
    listed = {_module_of(p) for p in PATHS.findall(lines[0])}
    taking = {name: where for name, path in MODULES.items()
              if (where := _takes_deployment(path))}
    assert {n: w for n, w in taking.items() if n not in listed} == {}, \
        "take a whole Deployment but are not in ARCHITECTURE.md's list"
    assert sorted(listed - set(taking)) == [], \
        "listed in ARCHITECTURE.md but take no whole Deployment (remove them from the list)"
    steps = {n: p for n, p in MODULES.items()
             if any(n == s or (s.endswith(".") and n.startswith(s)) for s in LAUNCH_STEPS)}
    assert [n for n in taking if n in steps] == []
    # nor do they reach for it through the prepared launch (``prepared.dep``)
    reach = [f"{n}:{node.lineno}" for n, path in steps.items()
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Attribute) and node.attr == "dep"]
    assert reach == []


def test_the_deployment_scan_sees_every_way_of_taking_it(tmp_path: Path) -> None:
    """The scan above finds a parameter, a keyword-only one, an optional one, a list and a
    field, and ignores names that only start with ``Deployment``."""
    mod = tmp_path / "m.py"
    mod.write_text(
        "from dataclasses import dataclass\n"
        "def a(dep: Deployment) -> None: ...\n"
        "def b(*, d: 'Deployment | None' = None) -> None: ...\n"
        "def c(ds: list[Deployment], s: DeploymentSettings) -> None: ...\n"
        "@dataclass\nclass H:\n    dep: Deployment\n    settings: DeploymentSettings\n",
        encoding="utf-8")
    assert _takes_deployment(mod) == ["a(dep)", "b(d)", "c(ds)", "field dep"]
