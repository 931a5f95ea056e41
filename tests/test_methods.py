"""The method table (``engine.methods``): its labels read back, its headings and colours are what the page, the
report and the video show, and no branch on a method's name lives outside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.errors import EngineError
from engine.methods import AUTO, BASELINE, METHODS, NAMES, TREE, Label, check_budget, method, print_rgb

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "engine" / "methods.py"
SOURCES = ("ddtree", "engine", "viz")
# what the method-name offences look like: a method's name, or a label with a budget
LABEL_PREFIX = f"{TREE.name}@"
STRING_METHODS = ("startswith", "endswith", "removeprefix", "removesuffix", "partition", "rpartition", "split",
                  "rsplit", "index", "find", "count", "replace")


def project_files() -> list[Path]:
    return [ROOT / "app.py"] + [path for package in SOURCES for path in sorted((ROOT / package).rglob("*.py"))
                                if path != TABLE]


def is_method_name(node: ast.AST) -> bool:
    """A string constant that names a method (``"ar"``) or starts a label with a budget (``"ddtree@32"``), or a
    tuple, list or set constant that holds one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and (node.value in NAMES or node.value.startswith(LABEL_PREFIX))
    if isinstance(node, ast.JoinedStr):  # f"ddtree@{budget}"
        return bool(node.values) and is_method_name(node.values[0])
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(is_method_name(element) for element in node.elts)
    return False


def branches_on_a_name(node: ast.AST) -> bool:
    """``node`` compares with a method's name, looks one up (``COLOURS["ddtree"]``), is a table keyed by them, cuts
    a label with one (``label.startswith("ddtree@")``) or writes a label by hand (``f"ddtree@{budget}"``)."""
    if isinstance(node, ast.Compare):
        return any(map(is_method_name, [node.left, *node.comparators]))
    if isinstance(node, ast.Subscript):
        return is_method_name(node.slice)
    if isinstance(node, ast.Dict):
        return sum(map(is_method_name, filter(None, node.keys))) >= 2  # one key is a record's field
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STRING_METHODS:
        return any(map(is_method_name, node.args))
    return isinstance(node, ast.JoinedStr) and is_method_name(node)


def offences(source: str) -> list[int]:
    """The lines where ``source`` branches on a method's name instead of reading the table."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if branches_on_a_name(node)})


def test_no_method_name_is_compared_outside_the_method_table():
    lines = []
    for path in project_files():
        source = path.read_text()
        lines += [f"{path.relative_to(ROOT)}:{line}: {source.splitlines()[line - 1].strip()}"
                  for line in offences(source)]
    assert not lines, "read engine.methods instead:\n" + "\n".join(lines)


@pytest.mark.parametrize("code", [
    'if settings.method == "ddtree": pass',
    'ar = traces["ar"]',
    'names = {"ar": "AR", "dflash": "DFlash"}',
    'if method in ("ar", "dflash"): pass',
    'if "ar" != method: pass',
    'drafts = method not in {"ar"}',
    'if label.startswith("ddtree@"): pass',
    'name, _, budget = label.partition("ddtree@")',
    'label = f"ddtree@{budget}"',
    'if label == f"ddtree@{budget}": pass',
])
def test_the_check_sees_each_kind_of_offence(code):
    assert offences(code), code


@pytest.mark.parametrize("code", [
    'if settings.method == BASELINE.name: pass',
    'ar = traces.get(BASELINE.name)',
    'colours = {"draft": "#ff7f0e", "verify": "#1f77b4"}',
    'label = "AR"',  # a title, not a name
    'if kind == "tree": pass',
    'row = {"ar": 1}',  # one key is a record's field, not a table of methods
])
def test_the_check_lets_the_table_s_reads_and_other_strings_be(code):
    assert not offences(code), code


# ---------------------------------------------------------------- the table itself


@pytest.mark.parametrize("text, name, budget, suffix", [
    ("ar", "ar", None, ""),
    ("dflash", "dflash", None, ""),
    ("ddtree@32", "ddtree", 32, ""),
    ("ddtree@auto", "ddtree", AUTO, ""),
    ("ddtree@8:tokens", "ddtree", 8, ":tokens"),
    ("ar:tokens", "ar", None, ":tokens"),
    ("vllm-ar", None, None, ""),
    ("ddtree@16+candidate", "ddtree", 16, ""),
    ("dflash+candidate:tokens", "dflash", None, ":tokens"),
])
def test_a_label_reads_back_its_method_budget_and_suffix(text, name, budget, suffix):
    label = Label.parse(text)
    assert (label.method.name if label.method else None, label.budget, label.suffix) == (name, budget, suffix)
    if label.method is not None:
        assert label.method.label(label.budget, label.drafter_tag) + label.suffix == text


@pytest.mark.parametrize("row", METHODS.values(), ids=NAMES)
@pytest.mark.parametrize("budget", [None, 1, 32, 1024, AUTO])
def test_every_label_a_row_writes_parses_back_to_it(row, budget):
    label = Label.parse(row.label(budget))
    assert label.method is row and not label.suffix
    assert label.budget == (budget if row.budgeted or (budget == AUTO and row.drafts) else None)


def test_labels_sort_by_the_tables_order_then_budget():
    labels = ["vllm-ar", "ddtree@64", "dflash:tokens", "ddtree@8:tokens", "ar", "ddtree@8", "dflash", "ar:tokens"]
    assert sorted(labels, key=lambda text: Label.parse(text).order) == [
        "ar", "ar:tokens", "dflash", "dflash:tokens", "ddtree@8", "ddtree@8:tokens", "ddtree@64", "vllm-ar"]
    assert [text for text in labels if Label.parse(text).is_baseline] == ["ar"]


def test_headings_are_what_the_page_the_report_and_the_video_show():
    assert [row.heading(32) for row in METHODS.values()] == ["AR", "DFlash", "DDTree@32"]
    assert [row.heading(32, long=True) for row in METHODS.values()] == ["AR", "DFlash", "DDTree · budget 32"]
    # a second drafter's runs carry its tag, AR (which drafts nothing) none
    assert [row.heading(32, drafter_tag="b") for row in METHODS.values()] == ["AR", "DFlash · b", "DDTree@32 · b"]
    assert [row.label(32, "b") for row in METHODS.values()] == ["ar", "dflash+b", "ddtree@32+b"]
    assert Label.parse("ddtree@32+b").heading == "DDTree@32 · b"
    assert [row.caption for row in METHODS.values()] == ["AR (target only)", "DFlash (chain)", "DDTree (tree)"]
    assert (BASELINE.name, TREE.name) == ("ar", "ddtree")


def test_the_colours_are_the_ones_the_figures_the_report_and_the_video_drew():
    assert [row.colour for row in METHODS.values()] == ["#7f7f7f", "#ff7f0e", "#1f6fd1"]  # plotly's, on the page
    assert [row.print_colour for row in METHODS.values()] == ["#94a3b8", "#38bdf8", "#f59e0b"]  # report's plots
    assert [print_rgb(row) for row in METHODS.values()] == [(148, 163, 184), (56, 189, 248), (245, 158, 11)]


def test_a_second_drafters_runs_draw_in_a_lighter_shade_of_their_methods_colour():
    assert [row.run_colour("b") for row in METHODS.values()] == ["#7f7f7f", "#ffb97a", "#84b0e6"]  # AR drafts nothing
    assert [row.run_colour() for row in METHODS.values()] == [row.colour for row in METHODS.values()]
    assert print_rgb(TREE, "b") == (250, 202, 121)


def test_an_unknown_method_is_refused_with_the_names_there_are():
    with pytest.raises(EngineError, match="unknown method 'mtp'; choose from ar, dflash, ddtree") as refused:
        method("mtp")
    assert refused.value.field == "method"


@pytest.mark.parametrize("value, budget", [(1, 1), (1024, 1024), ("16", 16), (" Auto ", AUTO)])
def test_a_budget_is_auto_or_a_whole_number_up_to_1024(value, budget):
    assert check_budget(value) == budget


@pytest.mark.parametrize("value", [0, 2000, -3, 16.5, True, "many", None])
def test_any_other_budget_is_refused_with_one_sentence(value):
    with pytest.raises(EngineError) as refused:
        check_budget(value)
    assert str(refused.value) == f'tree budget must be "auto" or a whole number from 1 to 1024, got {value!r}'
    assert refused.value.field == "tree_budget"
