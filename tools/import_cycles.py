"""Fail when modules of one package import each other in a circle.

A package is one of tessera's top-level packages with its subpackages (`tessera.core` holds
`core.parallel` and `core.models.t5`). A circle inside one (a -> b -> a, whether the import is
at module level or inside a function) means two modules are one design split in two files, or
a generic module that names its special cases. Imports under `if TYPE_CHECKING:` are left out:
they never run.

Usage (what `make lint` runs): python tools/import_cycles.py IMPORT_TREE
where IMPORT_TREE holds `tessera/` laid out as installed (the Makefile builds it).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import grimp


def package_of(module: str) -> str:
    """The top-level package: `tessera.core` for `tessera.core.models.t5.model`."""
    return ".".join(module.split(".")[:2])


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of size > 1 (iterative, so deep graphs cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
                continue
            if child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def main(tree: str) -> int:
    sys.path.insert(0, tree)
    graph = grimp.build_graph("tessera", exclude_type_checking_imports=True)
    edges: dict[str, set[str]] = defaultdict(set)
    modules = set(graph.modules)
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if package_of(imported) == package_of(module) and imported in modules:
                edges[module].add(imported)
    circles = strongly_connected(modules, edges)
    for circle in circles:
        print("import circle in " + package_of(circle[0]) + ": " + " <-> ".join(circle))
    print(f"import circles inside a package: {len(circles)}")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/import-tree"))
