"""Real prose and real code that every machine has: Python's own standard library source.

Docstrings give paragraphs of technical English for rewrite / summarise / translate
requests; function definitions give code to explain, fix, test, port or complete. Nothing
is downloaded, and the harvest is deterministic for a given Python installation.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SKIPPED_PACKAGES = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
                    "ensurepip", "pydoc_data", "__phello__", "encodings"}
MIN_PASSAGE_CHARS, MAX_PASSAGE_CHARS = 160, 900
MIN_FUNCTION_LINES, MAX_FUNCTION_LINES = 5, 40


@dataclass(frozen=True)
class Function:
    name: str
    source: str  # dedented definition, docstring included
    head: str  # signature and docstring (or first body line): what a "complete this" request shows


@dataclass(frozen=True)
class Harvest:
    passages: tuple[str, ...]
    functions: tuple[Function, ...]


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_PACKAGES & set(p.relative_to(root).parts[:-1]))


def prose_paragraphs(docstring: str) -> list[str]:
    """Paragraphs of a docstring that read as prose: no doctests, code or tables, mostly letters."""
    paragraphs = []
    for block in textwrap.dedent(docstring).split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if not lines or any(line.startswith((">>>", "...", "$", "|", "+-", "-- ", ":param", ":return"))
                            for line in lines):
            continue
        text = " ".join(lines)
        letters = sum(c.isalpha() or c == " " for c in text)
        if MIN_PASSAGE_CHARS <= len(text) <= MAX_PASSAGE_CHARS and letters >= 0.85 * len(text) and text[-1] in ".:!?":
            paragraphs.append(text)
    return paragraphs


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> Function | None:
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    body = lines[start - 1:node.end_lineno]
    if not MIN_FUNCTION_LINES <= len(body) <= MAX_FUNCTION_LINES or node.name.startswith("__"):
        return None
    source = textwrap.dedent("\n".join(body)).rstrip() + "\n"
    first = node.body[0]
    head_end = first.end_lineno if ast.get_docstring(node) and len(node.body) > 1 else first.lineno - 1
    head = textwrap.dedent("\n".join(lines[start - 1:max(head_end, node.lineno)])).rstrip() + "\n"
    return Function(node.name, source, head)


@functools.cache
def harvest(root: str | None = None) -> Harvest:
    """Every prose paragraph (deduplicated) and every mid-sized function of the standard library."""
    passages: dict[str, None] = {}
    functions: list[Function] = []
    for path in stdlib_files(Path(root) if root else None):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                passages.update(dict.fromkeys(prose_paragraphs(ast.get_docstring(node) or "")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (found := _function(node, lines)):
                functions.append(found)
    return Harvest(tuple(passages), tuple(functions))
