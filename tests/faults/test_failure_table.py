"""docs/fault_tolerance.md's failure table and the tests behind it cannot drift apart: every test a row names exists,
every test in tests/faults/ has a row, and every row gives a time to diagnosis."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "fault_tolerance.md"


def _rows() -> list[list[str]]:
    section = DOC.read_text().split("## Failure table", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| fault")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_row_names_existing_tests_and_a_time():
    rows = _rows()
    assert len(rows) >= 15
    for fault, _, tests, time_to_diagnosis in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", tests)
        assert named, f"row {fault!r} names no test"
        for path, name in named:
            assert name in _tests_in(ROOT / path), f"row {fault!r}: {path}::{name} does not exist"
        assert time_to_diagnosis and "TIME_" not in time_to_diagnosis, f"row {fault!r} has no time to diagnosis"


def test_every_fault_test_has_a_row():
    named = {(path, name) for row in _rows() for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row[2])}
    this = Path(__file__).name
    for path in sorted((ROOT / "tests" / "faults").glob("test_*.py")):
        if path.name == this:
            continue
        for name in _tests_in(path):
            assert (f"tests/faults/{path.name}", name) in named, f"tests/faults/{path.name}::{name} has no table row"
