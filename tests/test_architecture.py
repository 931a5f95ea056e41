"""The house's shape (ARCHITECTURE.md), read from the source with ``ast``: every import counts, also
those inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.loop.calibration import MEASURED_BUDGETS
from engine.loop.loading import SHIPPED_DRAFTER, shipped_drafter
from engine.models.protocols import FixedKV, TargetModel
from engine.on_vllm.vllm_engine import REPO
from tests.tiny import tiny_target

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ddtree", "engine", "viz")
# engine's rooms from the ground floor up: a room imports from its own floor and the floors below
FLOORS = (
    ("engine.errors", "engine.trace"),
    ("engine.gpu",),
    ("engine.models",),
    ("engine.loop",),
    ("engine.on_vllm",),
    ("engine.serving",),  # what the app and the server share: the model's queue, start-up, the OpenAI API
    ("engine.tools", "engine.training"),
)
MAX_TOP_LEVEL_MODULES = 6  # .py files directly in engine/, __init__.py included


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    paths = [ROOT / "app.py"] + [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return {module_name(path): path for path in paths}


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports anywhere in it: ``from a.b import c`` is ``a.b.c`` where
    that is a module, else ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    found.discard(module_name(path))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(path, modules) for name, path in modules.items()}


def room(module: str) -> str:
    return next(room for floor in FLOORS for room in floor if module == room or module.startswith(room + "."))


def floor(module: str) -> int:
    return next(level for level, rooms in enumerate(FLOORS) if room(module) in rooms)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # "open" while on the current path, "done" once all below it are seen

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for successor in sorted(graph[node]):
            if state.get(successor) == "open":
                return path[path.index(successor):] + [successor]
            if successor not in state and (cycle := visit(successor, path + [successor])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_module_graph_has_no_cycle(graph):
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_rooms_have_no_cycle(graph):
    """Not even room by room: each room leans on others without them leaning back."""
    engine = {name: deps for name, deps in graph.items() if name.startswith("engine.") and name != "engine"}
    rooms: dict[str, set[str]] = {}
    for name, deps in engine.items():
        rooms.setdefault(room(name), set()).update(room(dep) for dep in deps if dep in engine and room(dep) != room(name))
    assert find_cycle(rooms) is None, " -> ".join(find_cycle(rooms))


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_ddtree_imports_only_itself(graph):
    strays = {(name, dep) for name, deps in graph.items() if name.startswith("ddtree")
              for dep in deps if not dep.startswith("ddtree")}
    assert not strays


def test_engine_imports_neither_viz_nor_the_app(graph):
    strays = {(name, dep) for name, deps in graph.items() if name.startswith("engine")
              for dep in deps if dep.split(".")[0] in ("viz", "app")}
    assert not strays


def test_every_engine_room_imports_only_its_floor_and_below(graph):
    upward = {(name, dep) for name, deps in graph.items() if name.startswith("engine.")
              for dep in deps if dep.startswith("engine.") and floor(dep) > floor(name)}
    assert not upward


def test_the_runtime_imports_no_tool_and_no_training(graph):
    """Floors below the top run the app and the bench; command-line tools and training sit on them."""
    top = set(FLOORS[-1])
    strays = {(name, dep) for name, deps in graph.items() if name.startswith("engine.") and room(name) not in top
              for dep in deps if dep.startswith("engine.") and room(dep) in top}
    assert not strays


def test_every_engine_module_has_a_room(graph):
    for name in graph:
        if name.startswith("engine."):
            room(name)  # StopIteration names a module outside every floor


def test_engine_top_level_is_small():
    modules = sorted(path.name for path in (ROOT / "engine").glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_the_targets_and_caches_keep_their_protocols():
    target = tiny_target()
    assert isinstance(target, TargetModel)
    assert isinstance(target.fixed_kv(64), FixedKV)


def test_a_protocol_miss_is_seen():
    assert not isinstance(torch.nn.Linear(2, 2), TargetModel)


def test_paths_from_a_room_reach_the_repository():
    """Modules a floor deeper than before still find the repository's files."""
    assert REPO == ROOT
    assert MEASURED_BUDGETS.is_file()
    assert shipped_drafter() == SHIPPED_DRAFTER and SHIPPED_DRAFTER.is_relative_to(ROOT / "assets")
