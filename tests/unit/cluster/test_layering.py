"""The rooms of the architecture, checked on the source (parsed with ``ast``, nothing imported):

- the services (``learner/``, ``rollout/``, ``reward/``) import nothing from ``cluster/``, and one service
  imports another only for type annotations (under ``if TYPE_CHECKING:``);
- the algorithm core (``learner/objectives.py``, ``policy_metrics.py``, ``kl.py``, ``objective_names.py``,
  ``advantages.py``, ``logprobs.py``, ``gae.py``, ``distill.py``) imports no Ray, vLLM, DeepSpeed or config classes
  (CONTRIBUTING.md);
- loading the config (``cluster.config``, what ``--dry-run`` and ``cluster.submit`` do) does not import torch
  (checked in a fresh interpreter: the one exception to "nothing imported");
- no import circle anywhere in the project, lazy imports included;
- source files (600 lines) and functions (100 lines, docstring included) stay small enough to read;
- the tests keep their own rooms: test modules by kind in folders, importing helpers, never each other.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

SERVICES = ("learner", "rollout", "reward")


PACKAGES = (*SERVICES, "cluster")


CORE = ("learner/objectives.py", "learner/policy_metrics.py", "learner/kl.py", "learner/objective_names.py",
        "learner/advantages.py", "learner/logprobs.py", "learner/gae.py", "learner/distill.py")


CORE_FORBIDDEN = ("ray", "vllm", "deepspeed", "pydantic", "cluster", "learner.config", "rollout", "reward")


MAX_FILE_LINES = 600


MAX_FUNCTION_LINES = 100


def _sources(packages: tuple[str, ...]) -> list[Path]:
    return sorted(p for pkg in packages for p in (REPO_ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path) -> list[tuple[str, int, bool]]:
    """Every absolute module a file imports: ``[(module, line, under TYPE_CHECKING)]``. Covers ``import x``,
    ``from x import y`` (``from . import y`` resolves to the file's own package, which stays in its room) and
    ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno, type_only))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.args[0].value, node.lineno, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return out


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def room_violations(path: Path, own: str) -> list[str]:
    """The imports of ``path``, a file of the service ``own``, that break the rooms (one line each)."""
    bad = []
    for module, line, type_only in imported_modules(path):
        top = _top(module)
        if top == "cluster":
            bad.append(f"{_rel(path)}:{line} imports {module} (services import nothing from cluster/)")
        elif top in SERVICES and top != own and not type_only:
            bad.append(f"{_rel(path)}:{line} imports {module} at run time (another service: only under "
                       "`if TYPE_CHECKING:`)")
    return bad


def test_checker_sees_every_import_form(tmp_path):
    pkg = tmp_path / "reward"
    pkg.mkdir()
    src = pkg / "x.py"
    src.write_text(
        "from __future__ import annotations\n"
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "import cluster.config\n"                      # 4: cluster
        "from reward.config import RewardConfig\n"     # 5: own service: fine
        "from learner import objectives\n"             # 6: other service at run time
        "if TYPE_CHECKING:\n"
        "    from rollout.contracts import PromptRow\n"  # 8: other service, type only: fine
        "    from cluster.config import Config\n"        # 9: cluster, even type only
        "def f():\n"
        "    from cluster import plan\n"                 # 11: cluster, inside a function
        "    return importlib.import_module('cluster.data.prompts')\n"  # 12: cluster, by name
    )
    found = imported_modules(src)
    assert ("rollout.contracts", 8, True) in found and ("cluster.data.prompts", 12, False) in found
    bad_lines = [int(v.split(":")[1].split()[0]) for v in room_violations(src, "reward")]
    assert bad_lines == [4, 6, 9, 11, 12]


def test_services_import_nothing_from_cluster_and_other_services_only_for_types():
    files = _sources(SERVICES)
    assert len(files) > 10  # the walk found the packages
    bad = [v for path in files for v in room_violations(path, path.relative_to(REPO_ROOT).parts[0])]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", CORE)
def test_algorithm_core_is_pure_torch(name):
    bad = [f"{name}:{line} imports {module}" for module, line, _ in imported_modules(REPO_ROOT / name)
           if _within(module, CORE_FORBIDDEN)]
    assert not bad, "\n".join(bad)


# Modules that make `import cluster.config` slow and that the config does not need.
HEAVY_FOR_CONFIG = ("torch", "ray", "vllm", "deepspeed", "transformers")


@pytest.mark.parametrize("module", ["cluster.config", "cluster.submit.job"])
def test_config_loads_without_torch(module):
    """``import cluster.config`` (and ``cluster.submit``, which loads configs before it submits) in a fresh
    interpreter, run from another directory, leaves torch and the other heavy packages out of ``sys.modules``:
    the names of the objectives come from ``learner/objective_names.py``, not ``learner/objectives.py``."""
    code = (
        f"import sys; import {module}; "
        f"print(','.join(m for m in {HEAVY_FOR_CONFIG!r} if m in sys.modules)); "
        "print('learner.objective_names' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, names = out.stdout.splitlines()
    assert loaded == "", f"import {module} loads {loaded}"
    assert names == "True"  # the check looked at the import that matters


def _sized_sources() -> list[Path]:
    files = _sources(PACKAGES)
    assert len(files) > 20  # the walk found the packages
    return files


def test_no_source_file_over_600_lines():
    long = [f"{_rel(p)}: {n} lines" for p in _sized_sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, "\n".join(long)


def test_no_function_over_100_lines():
    long = []
    for path in _sized_sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file (module level or inside a function: a lazy
    import closes a circle as surely as a top-level one), type-only imports left out. ``from pkg import sub``
    counts as an import of ``pkg.sub`` when ``sub`` is a module of the project."""
    files = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, _line, type_only in imported_modules(path):
            if not type_only and name in files and name != module:
                graph[module].add(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in files and sub != module:
                        graph[module].add(sub)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def test_circle_checker_sees_a_lazy_circle(tmp_path):
    pkg = tmp_path / "cluster"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("from cluster.models import b\n")
    (pkg / "models" / "b.py").write_text("def f():\n    from cluster.models.a import x\n")  # lazy: still a circle
    (pkg / "models" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from cluster.models.a import x\n")  # type-only: no edge
    graph = import_graph(tmp_path, ("cluster",))
    assert graph["cluster.models.a"] == {"cluster.models", "cluster.models.b"} and graph["cluster.models.c"] == set()
    assert import_circles(graph) == [["cluster.models.a", "cluster.models.b"]]


def test_no_import_circle_in_the_project():
    graph = import_graph(REPO_ROOT, PACKAGES)
    assert len(graph) > 50 and sum(len(v) for v in graph.values()) > 100  # the walk found the imports
    circles = import_circles(graph)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


# ------------------------------------------------------------------------------------------------------------
# the tests' own rooms


def test_no_test_module_imports_another():
    """Test modules import helpers (``tests.helpers``), never another test module or the conftest."""
    files = sorted((REPO_ROOT / "tests").rglob("*.py"))
    assert len(files) > 40  # the walk found the tests
    bad = [f"{_rel(p)}:{line} imports {module}" for p in files for module, line, _ in imported_modules(p)
           if module == "tests.conftest" or module.split(".")[-1].startswith("test_")
           or module.startswith(("tests.unit", "tests.integration", "tests.matrix"))]
    assert not bad, "\n".join(bad)


def test_every_test_lives_in_a_kind_folder():
    """Tests by kind: every ``test_*.py`` is under ``tests/unit/<room>/``, ``tests/integration/`` or
    ``tests/matrix/`` (the conftest marks them by folder)."""
    rooms = {"learner", "rollout", "reward", "cluster"}
    misplaced = []
    for p in sorted((REPO_ROOT / "tests").rglob("test_*.py")):
        parts = p.relative_to(REPO_ROOT / "tests").parts
        ok = (parts[0] == "unit" and len(parts) == 3 and parts[1] in rooms) or (
            parts[0] in ("integration", "matrix") and len(parts) == 2)
        if not ok:
            misplaced.append(_rel(p))
    assert not misplaced, "\n".join(misplaced)


# ------------------------------------------------------------------------------------------------------------
# declared attributes


def undeclared_attributes(path: Path) -> list[str]:
    """Attributes a class assigns to ``self`` outside its constructor (``__init__`` / ``__post_init__``) that
    are neither assigned there nor declared in the class body (an annotation or a class attribute)."""
    bad = []
    for cls in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]:
        declared = {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        later: dict[str, int] = {}
        for fn in [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                for e in flat:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        if fn.name in ("__init__", "__post_init__"):
                            declared.add(e.attr)
                        else:
                            later.setdefault(e.attr, node.lineno)
        bad += [f"{_rel(path)}:{line} {cls.name}.{attr}" for attr, line in later.items() if attr not in declared]
    return bad


def test_attribute_checker_sees_a_late_attribute(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("class A:\n    b: int\n    def __init__(self):\n        self.a = 1\n"
                   "    def f(self):\n        self.a, self.b = 2, 3\n        self.c = 4\n        self.d[0] = 5\n")
    assert undeclared_attributes(src) == [f"{src}:7 A.c"]


def test_every_attribute_is_declared_in_the_constructor():
    bad = [v for p in _sources(PACKAGES) for v in undeclared_attributes(p)]
    assert not bad, "\n".join(bad)
