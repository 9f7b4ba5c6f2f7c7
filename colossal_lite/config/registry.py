"""The registry of config sections: how a feature adds a section to :class:`Settings`.

A :class:`Section` names the top-level config keys it owns and a ``parse(config, parsed)``
that turns the user's (plain, copied) config into one frozen value; ``parsed`` holds the
sections registered before it (the engine's section reads the pipeline's M there). A lazy
section is parsed on first read (the job's sections import the modules that register
models). A check (:func:`register_check`) sees the finished settings once and rejects
combinations of sections (ZeRO with apex amp, ...). The built-in sections are registered
by ``settings.py``; a feature registers its own the same way::

    register_section(Section('moe', ('moe',), lambda config, parsed: parse_moe(config.get('moe'))))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Tuple


@dataclass(frozen=True)
class Section:
    """One typed section of :class:`~.settings.Settings` (``settings.<name>``)."""

    name: str
    keys: Tuple[str, ...]
    parse: Callable[[Mapping, Mapping[str, Any]], Any]
    lazy: bool = False


_SECTIONS: Dict[str, Section] = {}
_CHECKS: List[Callable[[Any], None]] = []


def register_section(section: Section, replace: bool = False) -> Section:
    """Add ``section`` (parsed after those already registered); a taken name needs
    ``replace=True``."""
    if section.name in _SECTIONS and not replace:
        raise ValueError(f"config section '{section.name}' is already registered")
    _SECTIONS[section.name] = section
    return section


def register_check(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Run ``check(settings)`` once per parsed config, after its eager sections."""
    _CHECKS.append(check)
    return check


def sections() -> Tuple[Section, ...]:
    return tuple(_SECTIONS.values())


def section(name: str) -> Section:
    return _SECTIONS[name]


def checks() -> Tuple[Callable[[Any], None], ...]:
    return tuple(_CHECKS)


def top_level_keys() -> set:
    """Every top-level key some section owns."""
    return {key for s in _SECTIONS.values() for key in s.keys}
