"""The tests' own layout: folders that mirror the packages, file names unique across tests/ (pytest
imports each file under its name, and a few import helpers from another folder's file by it), and
the collection order's list of heavy files naming files that exist."""

import collections
import pathlib

from conftest import HEAVIEST_FIRST

TESTS = pathlib.Path(__file__).resolve().parents[1]
FILES = [p for p in TESTS.rglob("test_*.py") if "reference" not in p.relative_to(TESTS).parts]


def test_test_file_names_are_unique():
    by_name = collections.defaultdict(list)
    for path in FILES:
        by_name[path.name].append(path.relative_to(TESTS).as_posix())
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def test_the_heaviest_files_exist():
    assert [name for name in HEAVIEST_FIRST if not (TESTS / name).is_file()] == []
