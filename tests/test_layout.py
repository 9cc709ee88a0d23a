"""The layout rules of the source tree, checked by walking every module's imports with :mod:`ast`.

The rules (docs/ARCHITECTURE.md, "Layout"):

- no non-test module is over :data:`MAX_LINES` lines;
- no import cycle between files (a cycle hides which of two modules is the lower floor);
- no import cycle between packages (top-level folders: ``bus``, ``configs``, ``tasks``, ``policies``, ``trainer``,
  ...): each package is one floor, so two packages whose files import each other, even with no cycle between
  the files, have no order;
- no stage package (:data:`STAGES`) imports another: stages meet only on the bus;
- the lower floors (:data:`LIBRARIES`: ``bus``, ``configs``, ``tasks``, ``broadcaster``, ``policies``, ``runfiles``
  and the :data:`BASE` packages) import nothing from the stages or from the control plane (``busctl``); ``bus``
  imports nothing from the other libraries but the base packages (:data:`BASE`: ``configs``, ``telemetry``,
  ``lifecycle``), which import no other package (``configs`` validates without the bus, the bus counts its
  traffic in ``telemetry``); ``runfiles`` (what a run directory holds) sits above ``bus``, so ``bus`` never
  imports it;
- the stages import nothing from the control plane;
- inside a package, a module of a sub-package imports no module that sits directly in an ancestor package
  (``trainer.parallel.x`` never imports ``trainer.y``: the top of a package is its highest floor), and the
  sub-packages of one package have no import cycle between them (``trainer.forward`` <-> ``trainer.kernels``).

Every import counts, module-level or local (a lazy import inside a function is still a dependency). The same walk
runs on a small made-up tree first, so a checker that stopped seeing imports would fail here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
STAGES = frozenset({"prompts", "producers", "rewards", "packer", "trainer", "service"})
# service: busctl serve's HTTP API, a component that reaches the trainer and producers only over the bus
CONTROL_PLANE = frozenset({"busctl", "rlbus"})  # rlbus: the Python entry point (rlbus.run) over busctl up
BASE = frozenset({"configs", "telemetry", "lifecycle"})
LIBRARIES = BASE | frozenset({"bus", "tasks", "broadcaster", "policies", "runfiles"})
SKIPPED_DIRS = frozenset({"tests", "runs", "build", "dist", "node_modules"})


def source_modules(root: Path) -> dict[str, Path]:
    """Every ``.py`` file under ``root`` outside tests and hidden/build folders, by dotted module name."""
    mods: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIPPED_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        mods[name] = path
    return mods


def module_imports(path: Path, name: str, known: set[str] | dict[str, Path]) -> set[str]:
    """The modules of ``known`` that the file at ``path`` (module ``name``) imports, relative imports resolved.

    ``from a.b import c`` counts as importing ``a.b`` and, when ``a.b.c`` is a module, ``a.b.c``.
    Raises SyntaxError if the file does not parse.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    deps = set()
    for dotted in found:  # `import a.b.c` depends on the deepest known module of a.b.c
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            deps.add(dotted)
    return deps


def import_graph(root: Path) -> tuple[dict[str, Path], dict[str, set[str]]]:
    """(modules by name, module -> the project modules it imports) for the tree at ``root``."""
    mods = source_modules(root)
    return mods, {name: module_imports(path, name, mods) for name, path in mods.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan 1972), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages its modules import (from a module graph)."""
    top = lambda m: m.split(".")[0]
    packages: dict[str, set[str]] = {top(mod): set() for mod in graph}
    for mod, deps in graph.items():
        packages[top(mod)] |= {top(dep) for dep in deps} - {top(mod)}
    return packages


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that crosses a floor it must not cross, as ``"importer -> imported (rule)"``."""
    top = lambda m: m.split(".")[0]
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            a, b = top(mod), top(dep)
            if a == b:
                continue
            if a in STAGES and b in STAGES:
                bad.append(f"{mod} -> {dep} (a stage imports another stage)")
            elif a in STAGES | LIBRARIES and b in CONTROL_PLANE:
                bad.append(f"{mod} -> {dep} (only the control plane imports busctl)")
            elif a in LIBRARIES and b in STAGES:
                bad.append(f"{mod} -> {dep} (a library imports a stage)")
            elif a == "bus" and b in LIBRARIES - BASE:
                bad.append(f"{mod} -> {dep} (bus imports a higher library)")
            elif a in BASE:
                bad.append(f"{mod} -> {dep} ({a}, a base package, imports another package)")
    return bad


def package_names(mods: dict[str, Path]) -> set[str]:
    """The names in ``mods`` that are packages (an ``__init__.py``), not plain modules."""
    return {name for name, path in mods.items() if path.name == "__init__.py"}


def upward_imports(mods: dict[str, Path], graph: dict[str, set[str]]) -> list[str]:
    """Every import by a module of a sub-package (its ``__init__`` included) of a plain module that sits directly
    in an ancestor package, as ``"importer -> imported (a sub-package imports back up)"``."""
    packages = package_names(mods)
    bad = []
    for mod, deps in sorted(graph.items()):
        own = (mod if mod in packages else mod.rpartition(".")[0]).split(".")
        ancestors = {".".join(own[:i]) for i in range(1, len(own))}
        bad += [
            f"{mod} -> {dep} (a sub-package imports back up)"
            for dep in sorted(deps)
            if dep not in packages and dep.rpartition(".")[0] in ancestors
        ]
    return bad


def sub_package_cycles(mods: dict[str, Path], graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles between the sub-packages of each package (a sub-package imports another when any module
    under it imports any module under the other), each sorted; the top-level packages are
    :func:`package_graph`'s."""
    packages = package_names(mods)

    def child(mod: str, package: str) -> str | None:  # the sub-package of ``package`` that holds ``mod``
        if not mod.startswith(package + "."):
            return None
        sub = f"{package}.{mod[len(package) + 1 :].split('.')[0]}"
        return sub if sub in packages else None

    cycles = []
    for package in sorted(packages):
        subs: dict[str, set[str]] = {p: set() for p in packages if p.rpartition(".")[0] == package}
        for mod, deps in graph.items():
            if (a := child(mod, package)) is not None:
                subs[a] |= {b for dep in deps if (b := child(dep, package)) not in (None, a)}
        cycles += import_cycles(subs)
    return cycles


def oversized(mods: dict[str, Path]) -> list[str]:
    """Modules over :data:`MAX_LINES` lines, as ``"path: N lines"``."""
    sizes = {path: len(path.read_text().splitlines()) for path in mods.values()}
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {n} lines"
        for path, n in sorted(sizes.items())
        if n > MAX_LINES
    ]


@pytest.fixture(scope="module")
def project():
    return import_graph(ROOT)


def test_no_module_over_the_line_limit(project):
    mods, _ = project
    assert not oversized(mods), f"modules over {MAX_LINES} lines: {oversized(mods)}"


def test_no_import_cycle_between_files(project):
    _, graph = project
    assert not import_cycles(graph)


def test_no_import_cycle_between_packages(project):
    _, graph = project
    assert not import_cycles(package_graph(graph))


def test_no_import_crosses_a_floor(project):
    _, graph = project
    assert not forbidden_imports(graph)


def test_no_sub_package_imports_back_up(project):
    mods, graph = project
    assert not upward_imports(mods, graph)


def test_no_import_cycle_between_sub_packages(project):
    mods, graph = project
    assert not sub_package_cycles(mods, graph)


def test_every_package_is_seen(project):
    mods, graph = project
    tops = {m.split(".")[0] for m in mods}
    assert STAGES | LIBRARIES | CONTROL_PLANE <= tops, (
        f"missing packages: {(STAGES | LIBRARIES | CONTROL_PLANE) - tops}"
    )
    assert sum(len(d) for d in graph.values()) > 200  # the walk sees the project's imports


def test_the_checker_sees_each_kind_of_fault(tmp_path):
    """A made-up tree with one fault of each kind: the same functions must report every one."""
    files = {
        "producers/__init__.py": "",
        "producers/a.py": "from rewards import b\nimport producers.c\n",
        "producers/c.py": "def f():\n    from . import a\n",  # a local relative import closes a cycle
        "rewards/__init__.py": "",
        "rewards/b.py": "x = 1\n" * (MAX_LINES + 1),
        "producers/sub/__init__.py": "",
        "producers/sub/x.py": "from .. import c\n",  # a relative import back up
        "rewards/fwd/__init__.py": "from rewards import b\n",  # a sub-package's __init__ imports back up
        "rewards/fwd/f.py": "from rewards.kern import k\n",  # with kern.m: two sub-packages that import each
        "rewards/fwd/g.py": "",  # other, with no cycle between files
        "rewards/kern/__init__.py": "",
        "rewards/kern/k.py": "",
        "rewards/kern/m.py": "import rewards.fwd.g\n",
        "bus/__init__.py": "",
        "bus/w.py": "from tasks.t import T\nimport busctl.cli\nimport runfiles.r\n",
        "runfiles/__init__.py": "",
        "runfiles/r.py": "",
        "tasks/__init__.py": "",
        "tasks/t.py": "from packer.p import P\n",
        "tasks/u.py": "import broadcaster.v\n",  # with broadcaster.x: two libraries that import each other,
        "broadcaster/__init__.py": "",  # no floor rule broken and no cycle between files
        "broadcaster/v.py": "",
        "broadcaster/x.py": "from tasks.t import T\n",
        "configs/__init__.py": "",
        "configs/s.py": "def check():\n    from bus import w\n",  # a lazy import is an import
        "telemetry/__init__.py": "",
        "telemetry/m.py": "import lifecycle\n",  # a base package imports nothing, even another base package
        "lifecycle/__init__.py": "",
        "packer/__init__.py": "",
        "packer/p.py": "",
        "busctl/__init__.py": "",
        "busctl/cli.py": "from producers import a\n",  # allowed: the control plane may import stages
        "tests/test_x.py": "from producers import a\n" * (MAX_LINES + 1),  # tests are not walked
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods, graph = import_graph(tmp_path)
    assert "tests.test_x" not in mods
    assert [p.name for p in map(Path, (s.split(":")[0] for s in oversized(mods)))] == ["b.py"]
    assert import_cycles(graph) == [["producers.a", "producers.c"]]  # the only cycle between files
    assert import_cycles(package_graph(graph)) == [["broadcaster", "tasks"]]  # producers -> producers is no cycle
    assert upward_imports(mods, graph) == [
        "producers.sub.x -> producers.c (a sub-package imports back up)",  # `from .. import c`, resolved
        "rewards.fwd -> rewards.b (a sub-package imports back up)",
    ]
    assert sub_package_cycles(mods, graph) == [["rewards.fwd", "rewards.kern"]]
    assert forbidden_imports(graph) == [
        "bus.w -> busctl.cli (only the control plane imports busctl)",
        "bus.w -> runfiles.r (bus imports a higher library)",
        "bus.w -> tasks.t (bus imports a higher library)",
        "configs.s -> bus (configs, a base package, imports another package)",
        "configs.s -> bus.w (configs, a base package, imports another package)",
        "producers.a -> rewards (a stage imports another stage)",  # `from rewards import b` runs rewards/__init__
        "producers.a -> rewards.b (a stage imports another stage)",
        "tasks.t -> packer.p (a library imports a stage)",
        "telemetry.m -> lifecycle (telemetry, a base package, imports another package)",
    ]


def test_test_files_have_unique_names():
    """pytest imports test files without packages (rootdir-relative basenames): two test files of
    the same name in different folders make the whole collection fail ("import file mismatch")."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, f"test files with the same name: {clashes}; rename one"
