"""The shape the house keeps (what the structure map checks, as tests): no C file over 500
lines, every module with a short module docstring, and no docstring or C comment quoting a
benchmark figure or a machine (figures belong in docs/, where the next kernel's run
replaces them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import gateway

ROOT = Path(gateway.__file__).parent
C_FILES = sorted(ROOT.rglob("*.c")) + sorted(ROOT.rglob("*.h"))
PY_FILES = sorted(ROOT.rglob("*.py"))
# Machines and throughput units: what a measurement, not a design, says.
MAX_MODULE_DOCSTRING_LINES = 10
FIGURE = re.compile(r"\b(EPYC|Xeon|Zen ?\d|Sapphire Rapids|Graviton|[AH]100|H200)\b"
                    r"|\bGB/s\b|\btok/s\b", re.IGNORECASE)


def test_c_files_exist_to_be_checked():
    assert C_FILES


@pytest.mark.parametrize("path", C_FILES, ids=lambda path: path.name)
def test_no_c_file_is_over_500_lines(path: Path):
    assert len(path.read_text().splitlines()) <= 500


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [tree, *(node for node in ast.walk(tree) if isinstance(
        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return [doc for node in nodes if (doc := ast.get_docstring(node))]


@pytest.mark.parametrize("path", PY_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_module_has_a_short_docstring(path: Path):
    """What the module is for and which process runs it, in a few lines; detail belongs in
    the docstring of the class or function it describes, or in docs/."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, "no module docstring"
    assert len(doc.splitlines()) <= MAX_MODULE_DOCSTRING_LINES


def test_the_check_sees_a_figure():
    assert FIGURE.search("on a 2-core AMD EPYC it streams at 21 GB/s")
    assert FIGURE.search("85.4 tok/s through HTTP")
    assert not FIGURE.search("Avg generation throughput: %.1f tokens/s, Running")


@pytest.mark.parametrize("path", PY_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_docstring_quotes_a_figure(path: Path):
    assert [doc for doc in _docstrings(path) if FIGURE.search(doc)] == []


@pytest.mark.parametrize("path", C_FILES, ids=lambda path: path.name)
def test_no_c_comment_quotes_a_figure(path: Path):
    comments = re.findall(r"/\*.*?\*/|//[^\n]*", path.read_text(), re.DOTALL)
    assert [c for c in comments if FIGURE.search(c)] == []
