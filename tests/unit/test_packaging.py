"""Every folder that holds Python code ships in the wheel: pyproject lists it.

Our packages are mapped from top-level folders (`tessera.core` = `core/`), so setuptools finds
no subpackage by itself; an editable install finds a folder that is not listed anyway, which is
how a new folder goes missing only from a built wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
TOP = ("tessera", "core", "training", "tuning", "converters", "serving", "clients", "plan")


def _package_folders() -> dict[str, str]:
    """Package name -> folder, for every folder with an __init__.py under the top folders."""
    found = {}
    for top in TOP:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT).as_posix()
            parts = folder.split("/")
            name = "tessera" if folder == "tessera" else ".".join(["tessera", *parts])
            found[name] = folder
    return found


def test_pyproject_lists_every_package_folder():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = _package_folders()
    assert len(folders) > 10  # the real tree
    assert sorted(setup["packages"]) == sorted(folders)
    assert setup["package-dir"] == folders
