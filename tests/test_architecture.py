"""The library's layering, read from its source: no import circle (imports inside functions
counted) and no module importing one on a higher layer (``testing/architecture.py``'s
table, drawn in docs/architecture.md). The checker itself must catch a planted violation."""
from __future__ import annotations

import os

import pytest

from colossal_lite.testing.architecture import (LAYERS, cycles, import_graph, layer_of,
                                                read_tree, upward_imports)

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'colossal_lite')


@pytest.fixture(scope='module')
def tree():
    return read_tree(ROOT)


def _show(edges):
    return '\n'.join(f'  {e.source}:{e.line} imports {e.target}'
                     + (' (inside a function)' if e.local else '') for e in edges)


def test_no_import_circle(tree):
    found = cycles(import_graph(tree))
    assert not found, 'import circles:\n' + '\n'.join('  ' + ' <-> '.join(c) for c in found)


def test_no_module_imports_a_higher_layer(tree):
    up = upward_imports(import_graph(tree))
    assert not up, 'imports of a higher layer:\n' + _show(up)


def test_every_module_is_on_a_layer(tree):
    for module in tree:
        layer_of(module)


def test_a_planted_upward_import_and_circle_are_caught(tree):
    """``config.checks`` (the ground floor) importing the planner: an upward import, and a
    circle (the planner imports the config package), each reported with file and line."""
    planted = dict(tree)
    source, is_pkg = planted['colossal_lite.config.checks']
    planted['colossal_lite.config.checks'] = (
        source + '\n\ndef _planted():\n    from ..auto.planner import plan\n', is_pkg)
    edges = import_graph(planted)
    before = set(upward_imports(import_graph(tree)))
    added = [e for e in upward_imports(edges) if e not in before]
    assert [(e.source, e.target, e.local) for e in added] == [
        ('colossal_lite.config.checks', 'colossal_lite.auto.planner', True)]
    assert added[0].line == source.count('\n') + 4
    assert any('colossal_lite.config.checks' in c and 'colossal_lite.auto.planner' in c
               for c in cycles(edges))


def test_layers_name_each_prefix_once():
    prefixes = [p for layer in LAYERS for p in layer]
    assert len(prefixes) == len(set(prefixes))


def test_library_modules_are_imported_at_module_level(tree):
    """With no circle left, no import of a library module needs to hide inside a function
    (imports of optional third-party packages may)."""
    local = [e for e in import_graph(tree) if e.local]
    assert not local, 'imports of library modules inside functions:\n' + _show(local)
