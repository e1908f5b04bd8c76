"""The package's module import graph, from the source (AST, standard library only).

    python scripts/import_graph.py [--edges]

Prints the number of modules, edges, floors (the longest import chain, in
modules: the depth of the graph once circles are collapsed), the circles
(strongly connected components of more than one module) and the private
names (``_x``) imported from another module of the package.  Every
import counts, also one inside a function (a lazy import is still a
dependency), and so does one under ``if TYPE_CHECKING:`` (a reader still
has to follow it). Dunder names (``__version__``) are not private.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "pyllama_headinfer"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, name: str, modules: set[str]):
    """(imported module, private name or None) for each package import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE):
                    yield _existing(a.name, modules), None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(PACKAGE):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:  # `from . import x`: x is a module
                    yield sub, None
                else:
                    yield _existing(target, modules), (a.name if a.name.startswith("_") and not a.name.startswith("__") else None)


def _existing(name: str, modules: set[str]) -> str:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def graph(root: Path):
    files = {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}
    modules = set(files)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for m, p in files.items():
        for target, priv in imports(p, m, modules):
            if target == m:
                continue
            # a package's __init__ is imported on the way to a submodule; not an edge of its own
            edges[m].add(target)
            if priv and target != m:
                private.append((m, target, priv))
    return edges, private


def sccs(edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def floors(edges, comps):
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    memo = {}

    def height(i):
        if i not in memo:
            memo[i] = 1 + max((height(comp_of[w]) for m in comps[i] for w in edges[m] if comp_of[w] != i),
                              default=0)
        return memo[i]

    return max(height(i) for i in range(len(comps)))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(__file__).resolve().parent.parent
    edges, private = graph(root)
    comps = sccs(edges)
    circles = [c for c in comps if len(c) > 1]
    print(f"modules: {len(edges)}")
    print(f"edges: {sum(len(v) for v in edges.values())}")
    print(f"floors: {floors(edges, comps)}")
    print(f"circles: {len(circles)}")
    for c in circles:
        print("  " + " <-> ".join(c))
    print(f"private names imported across modules: {len(private)}")
    for m, t, n in private:
        print(f"  {m} <- {t}.{n}")
    if "--edges" in args:
        for m in sorted(edges):
            print(m, "->", ", ".join(sorted(edges[m])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
