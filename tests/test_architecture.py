"""The house's shape (ARCHITECTURE.md), read from the source with ``ast``: every import counts, also
those inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.loop.loading import SHIPPED_DRAFTER, shipped_drafter
from engine.measure.calibration import MEASURED_BUDGETS
from engine.models.protocols import FixedKV, TargetModel
from engine.on_vllm.vllm_engine import REPO
from tests.tiny import tiny_target

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
PACKAGES = ("ddtree", "engine", "viz")
# engine's rooms from the ground floor up: a room imports from its own floor and the floors below
FLOORS = (
    ("engine.errors", "engine.methods", "engine.trace"),
    ("engine.gpu",),
    ("engine.models",),
    ("engine.loop",),
    ("engine.measure",),
    ("engine.on_vllm",),
    ("engine.serving",),  # what the app and the server share: the model's queue, start-up, the OpenAI API
    ("engine.tools", "engine.training"),
)
ROOMS = tuple(room for floor in FLOORS for room in floor)
TOP_FLOOR = FLOORS[-1]
SERVING = "engine.serving"
PAGE = "viz.page"  # the page's views: they start runs on the model's queue, as app.py does
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


def room_of(module: str) -> str | None:
    return room(module) if module.startswith("engine.") else None


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
        others = {room(dep) for dep in deps if dep in engine} - {room(name)}
        rooms.setdefault(room(name), set()).update(others)
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
    homeless = [name for name in graph if name.startswith("engine.")
                and not any(name == room or name.startswith(room + ".") for room in ROOMS)]
    assert homeless == []


def in_page(module: str) -> bool:
    return module == PAGE or module.startswith(PAGE + ".")


def test_viz_imports_no_tool_no_training_and_no_serving(graph):
    """Figures read what runs measured; they never wait on a command, a training run or the model's queue. The
    page's views start runs, so they may reach the queue (``engine.serving``), and no more than figures may."""
    strays = {(name, dep) for name, deps in graph.items() if name.startswith("viz")
              for dep in deps if dep.startswith("engine.")
              and room(dep) in TOP_FLOOR + (() if in_page(name) else (SERVING,))}
    assert not strays


def test_only_the_app_the_pages_views_and_the_tools_import_serving(graph):
    importers = {name for name, deps in graph.items() if any(room_of(dep) == SERVING for dep in deps)}
    assert {name for name in importers if name != "app" and not in_page(name)
            and room_of(name) not in ("engine.tools", SERVING)} == set()


def test_only_the_app_and_the_page_import_the_pages_views(graph):
    """The views sit on top of figures and the engine: a figure or an engine module that needed one would go round
    in a circle."""
    strays = {(name, dep) for name, deps in graph.items() if name != "app" and not in_page(name)
              for dep in deps if in_page(dep)}
    assert not strays


def code_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```\n(.*?)^```", markdown, re.M | re.S)


def arrow_floors(markdown: str) -> tuple[tuple[str, ...], ...]:
    """The arrows picture's top line (``tools, training ──▶ serving ──▶ ... ──▶ errors, trace``), ground
    floor first."""
    line = next(line for block in code_blocks(markdown) for line in block.splitlines() if "──▶" in line)
    floors = reversed(line.split("──▶"))
    return tuple(tuple(f"engine.{name.strip()}" for name in floor.split(",")) for floor in floors)


def pictured_rooms(markdown: str) -> list[str]:
    """The engine rooms of the floors picture (the first drawing), top floor first."""
    lines = code_blocks(markdown)[0].splitlines()
    return [re.sub(r"(\.py)?/?$", "", path).replace("/", ".")
            for line in lines if line.startswith("engine/") for path in re.findall(r"engine/\w+(?:\.py|/)", line)]


def documented_files(markdown: str) -> set[str]:
    """The files the rooms table names, as paths: a row's backticked file names sit in its room, and a row
    with an empty first cell goes on with the room above it."""
    rows = markdown.split("## The rooms", 1)[1].split("\n## ", 1)[0].splitlines()
    found, room = set(), None
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if not row.startswith("|") or len(cells) < 3:
            continue
        if cells[0].startswith("`"):
            room = cells[0].strip("`")
        elif cells[0]:
            continue  # the header and its rule
        found |= {room + name for name in re.findall(r"`([\w.]+\.(?:py|sh|md))`", cells[1])}
    return found


def module_files() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if path.name != "__init__.py"}


def test_architecture_names_every_module_in_its_room():
    assert module_files() - documented_files(ARCHITECTURE.read_text()) == set()


def test_architecture_names_no_file_that_is_gone():
    assert {path for path in documented_files(ARCHITECTURE.read_text()) if not (ROOT / path).is_file()} == set()


def test_the_rooms_table_reader_sees_rooms_and_misses():
    table = """## The rooms

| room | modules | what |
|---|---|---|
| `ddtree/` | `tree.py` | the tree |
| | `verify.py`, `cache.py` | the walk; `not_a_file` |
| `viz/` | `figures.py` | figures |

## Next
| `engine/` | `later.py` | not in the rooms |
"""
    assert documented_files(table) == {"ddtree/tree.py", "ddtree/verify.py", "ddtree/cache.py", "viz/figures.py"}


def test_the_floors_are_the_ones_architecture_draws():
    markdown = ARCHITECTURE.read_text()
    assert arrow_floors(markdown) == FLOORS
    assert pictured_rooms(markdown) == [room for floor in reversed(FLOORS) for room in floor]


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


def test_the_tree_passes_its_linter():
    """``ruff check .`` with the house's rules (pyproject.toml): line length, imports, pyflakes, bugbear."""
    checked = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout[-3000:]
