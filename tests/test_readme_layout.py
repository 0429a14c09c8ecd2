"""The README's Layout table against the package: each room it names maps to that
folder in pyproject.toml and imports under that name, and nothing else of a checkout
(tests/, gpu/) is importable as part of zerod."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import zerod

ROOT = Path(__file__).resolve().parent.parent


def layout_rooms() -> dict[str, str]:
    """{import name: folder} from the README's Layout table rows that have an import name."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Layout\n"):].split("\n\n")[1]
    rooms = {}
    for m in re.finditer(r"^\| `([\w/]+)/` \| `(zerod(?:\.\w+)?)` \|", table, re.M):
        rooms[m.group(2)] = m.group(1)
    return rooms


def test_the_layout_table_is_the_package_dir_mapping():
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    code_rooms = {name: folder for name, folder in package_dir.items() if name != "zerod.systemd"}
    assert layout_rooms() == code_rooms
    # zerod/__init__.py maps the same folders for a checkout run without an install.
    assert {f"zerod.{room}" for room in zerod.ROOMS} == set(package_dir) - {"zerod"}


@pytest.mark.parametrize("name", sorted(layout_rooms()))
def test_each_room_imports_from_its_folder(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).parent == ROOT / layout_rooms()[name]


def test_a_plain_checkout_exposes_the_rooms_and_nothing_else():
    # No install: a fresh interpreter without site-packages (-S), only the checkout on its
    # path, so zerod/__init__.py alone finds the rooms.
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "import importlib, zerod\n"
        "for room in zerod.ROOMS:\n"
        "    print(room, list(importlib.import_module('zerod.' + room).__path__)[0])\n"
        "for name in ('zerod.tests', 'zerod.gpu', 'zerod.scripts'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    print(name, 'is importable')\n")
    p = subprocess.run([sys.executable, "-S", "-c", code], cwd="/", capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == [f"{room} {ROOT / room}" for room in zerod.ROOMS]
