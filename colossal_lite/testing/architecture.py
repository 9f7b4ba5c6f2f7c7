"""The library's import graph, read from the source (every import, also those inside
functions), and the layering it must keep (``docs/architecture.md``).

:func:`import_graph` parses each module of a package tree and resolves every ``import`` /
``from ... import`` to the modules it runs: ``from pkg import name`` runs ``pkg`` (its
``__init__``) and, when there is one, the submodule ``pkg.name`` -- so ``from .. import x``
depends on the parent package's ``__init__`` and everything it imports. :func:`cycles` gives the
strongly connected components with more than one module; :func:`upward_imports` the
imports whose target sits on a higher layer of :data:`LAYERS` than the importer.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

# lowest first; a module is on the layer of the longest prefix naming it
LAYERS: Sequence[Tuple[str, ...]] = (
    ('colossal_lite.config', 'colossal_lite.models', 'colossal_lite._version'),
    ('colossal_lite.context',),
    ('colossal_lite.communication',),
    ('colossal_lite.tensor', 'colossal_lite.formulas'),
    ('colossal_lite.nn', 'colossal_lite.data'),
    ('colossal_lite.amp',),
    ('colossal_lite.engine',),
    ('colossal_lite.pipeline', 'colossal_lite.zero'),
    ('colossal_lite.initialize', 'colossal_lite.launch', 'colossal_lite.checkpoint',
     'colossal_lite.generation'),
    ('colossal_lite.trainer',),
    ('colossal_lite.job', 'colossal_lite.run_state', 'colossal_lite.launcher',
     'colossal_lite.testing'),
    ('colossal_lite.auto', 'colossal_lite.worker'),
    ('colossal_lite.commands',),
    ('colossal_lite.cli',),
    ('colossal_lite',),
)


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target`` at ``line`` (``local``: inside a function)."""

    source: str
    target: str
    line: int
    local: bool


def read_tree(root: str) -> Dict[str, Tuple[str, bool]]:
    """{dotted module name: (source, is a package ``__init__``)} of every ``.py`` file under
    the package directory ``root``."""
    base = os.path.dirname(os.path.abspath(root))
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, base)[:-3].split(os.sep)
                if parts[-1] == '__init__':
                    parts = parts[:-1]
                with open(path, encoding='utf-8') as f:
                    out['.'.join(parts)] = (f.read(), name == '__init__.py')
    return out


def import_graph(tree: Mapping[str, Tuple[str, bool]], package: str = 'colossal_lite'
                 ) -> List[Import]:
    """Every import between modules of ``tree`` (``read_tree``'s form)."""
    parsed = {name: (ast.parse(src), is_pkg) for name, (src, is_pkg) in tree.items()}
    edges = []
    for name, (mod, is_pkg) in parsed.items():
        local = {id(node) for fn in ast.walk(mod)
                 if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(mod):
            for target in _targets(node, name, is_pkg, parsed):
                if target.split('.')[0] == package and target != name:
                    edges.append(Import(name, target, node.lineno, id(node) in local))
    return edges


def _targets(node, name: str, is_pkg: bool, modules) -> Iterable[str]:
    if isinstance(node, ast.Import):
        return [_known(a.name, modules) for a in node.names if _known(a.name, modules)]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = name.split('.') if is_pkg else name.split('.')[:-1]
        base = base[:len(base) - node.level + 1]
        module = '.'.join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ''
    out = [_known(module, modules)] if _known(module, modules) else []
    out += [f'{module}.{a.name}' for a in node.names if f'{module}.{a.name}' in modules]
    return out


def _known(name: str, modules) -> Optional[str]:
    while name and name not in modules:
        name = name.rpartition('.')[0]
    return name or None


def cycles(edges: Sequence[Import]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: Dict[str, Set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def layer_of(module: str, layers: Sequence[Tuple[str, ...]] = LAYERS) -> int:
    """The index in ``layers`` of the longest prefix naming ``module``."""
    best, found = -1, None
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + '.')) and len(prefix) > best:
                best, found = len(prefix), i
    if found is None:
        raise KeyError(f'{module} is on no layer of the architecture table')
    return found


def upward_imports(edges: Sequence[Import], layers: Sequence[Tuple[str, ...]] = LAYERS
                   ) -> List[Import]:
    """The imports whose target is on a higher layer than their source."""
    return [e for e in edges if layer_of(e.target, layers) > layer_of(e.source, layers)]
