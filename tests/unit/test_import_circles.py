"""No import circle between the modules of one package, imports inside functions included:
`tools/import_cycles.py` (what `make lint` runs) over a tree laid out as installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("core", "training", "tuning", "converters", "serving", "clients", "plan")


def _tree(tmp_path: Path, extra: dict[str, str] | None = None) -> Path:
    """`tessera/` linked to the repository's folders, plus `extra` files (path: text) written
    beside them (to plant a circle)."""
    pkg = tmp_path / "tessera"
    pkg.mkdir()
    for f in (ROOT / "tessera").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    for d in SUBPACKAGES:
        (pkg / d).symlink_to(ROOT / d)
    for name, text in (extra or {}).items():
        (pkg / name).parent.mkdir(exist_ok=True)
        (pkg / name).write_text(text)
    return tmp_path


def _check(tree: Path) -> subprocess.CompletedProcess:
    # A fresh interpreter, so `tessera` is the tree's and not the one this process imported.
    return subprocess.run([sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(tree)],
                          capture_output=True, text=True, cwd=tree)


def test_no_package_has_an_import_circle(tmp_path):
    out = _check(_tree(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "import circles inside a package: 0" in out.stdout


def test_a_circle_hidden_inside_a_function_is_found(tmp_path):
    planted = {"planted/__init__.py": "",
               "planted/circle_a.py": "def f():\n    from tessera.planted import circle_b\n",
               "planted/circle_b.py": "from tessera.planted import circle_a\n"}
    out = _check(_tree(tmp_path, planted))
    assert out.returncode == 1
    assert "tessera.planted.circle_a <-> tessera.planted.circle_b" in out.stdout
