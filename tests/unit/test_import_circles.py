"""No import circle inside the packages whose families live behind registries (converters,
plan), counting imports inside functions too: built with grimp (import-linter's graph) over
the tree `make lint` lays out, `tessera/<package>` linked to the top-level folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("core", "training", "tuning", "converters", "serving", "clients", "plan")


# Run in a fresh interpreter from the tree, so `tessera` is the tree's and not the one this
# test process has imported already.
_GRAPH = ("import grimp, json; g = grimp.build_graph('tessera', cache_dir=None); "
          "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) "
          "for m in g.modules}))")


def circles(imports: dict[str, list[str]], package: str) -> list[list[str]]:
    """The strongly connected groups of more than one module inside `package` (Tarjan)."""
    mods = sorted(m for m in imports if m == package or m.startswith(package + "."))
    inside = set(mods)
    edges = {m: sorted(d for d in imports[m] if d in inside) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for m in mods:
        if m not in index:
            visit(m)
    return found


@pytest.fixture(scope="module")
def imports(tmp_path_factory) -> dict[str, list[str]]:
    """Module -> the modules it imports (anywhere in it), for the whole `tessera` tree."""
    tree = tmp_path_factory.mktemp("import-tree")
    (tree / "tessera").mkdir()
    for f in (ROOT / "tessera").glob("*.py"):
        (tree / "tessera" / f.name).symlink_to(f)
    for d in SUBPACKAGES:
        (tree / "tessera" / d).symlink_to(ROOT / d)
    out = subprocess.run([sys.executable, "-c", _GRAPH], cwd=tree, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("package", ["tessera.converters", "tessera.plan"])
def test_no_import_circle_inside(imports, package):
    assert len([m for m in imports if m.startswith(package + ".")]) > 15  # the real tree
    assert circles(imports, package) == []
