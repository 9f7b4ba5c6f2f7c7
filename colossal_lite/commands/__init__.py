"""Subcommands of ``colossal-lite`` besides ``train`` (which lives in ``colossal_lite.cli``).

Each module named in :data:`COMMANDS` defines ``add_parser(subparsers)``: it adds its
subparser and sets ``run=<function(args) -> exit status>`` as the parser's default. A
module's import stays cheap (torch and the library are imported inside ``run``).
"""
from __future__ import annotations

import importlib

COMMANDS: tuple = ('generate', 'eval', 'export', 'plan')


def add_parsers(subparsers) -> None:
    for name in COMMANDS:
        importlib.import_module(f'{__name__}.{name}').add_parser(subparsers)
