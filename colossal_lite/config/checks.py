"""The one set of checking helpers every config section uses.

Each helper reads one value and either returns it normalized or raises
:class:`ConfigError` with a message that names the key (dotted, as the user wrote it),
the constraint and the value. Nothing here imports the rest of the library.
"""
from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Dict, Iterable, Mapping, Optional


class ConfigError(ValueError):
    """A configuration value breaks a constraint; the message names key, constraint and value."""


def suggest(key: str, known: Iterable[str]) -> str:
    """'; did you mean X?' for the closest known key, else the list of known keys."""
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else f"; known keys: {sorted(known)}"


def check_keys(section: Mapping, known: Iterable[str], where: str):
    """Every key of ``section`` is one of ``known``; ``where`` prefixes the key ('zero.')."""
    known = set(known)
    for key in section:
        if key not in known:
            raise ConfigError(f"unknown config key '{where}{key}'{suggest(key, known)}")


def mapping(value: Any, key: str, example: str, required: bool = False) -> Dict[str, Any]:
    """A section's dict (a copy; {} for None unless ``required``)."""
    if value is None:
        if required:
            raise ConfigError(f"the config needs a '{key}' section, e.g. {key}={example}")
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"'{key}' must be a dict like {example}, got {value!r}")
    return dict(value)


def is_positive_finite(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Real)
            and math.isfinite(value) and value > 0)


def positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"'{key}' must be a positive integer, got {value!r}")
    return int(value)


def count(value: Any, key: str) -> int:
    """An integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(f"'{key}' must be an integer >= 0, got {value!r}")
    return int(value)


def positive_number(value: Any, key: str, allow_none: bool = False) -> Optional[float]:
    """A positive finite float (None passes when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not is_positive_finite(value):
        raise ConfigError(f"'{key}' must be a positive finite number"
                          f"{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


def flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"'{key}' must be True or False, got {value!r}")
    return value


def in_range(value: Any, key: str, lo: float = 0.0, hi: float = math.inf,
             integer: bool = False):
    """``value`` (None passes) as a number (an integer when ``integer``) in [lo, hi]."""
    if value is None:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not lo <= value <= hi:
        what = 'an integer' if integer else 'a number'
        raise ConfigError(f"'{key}' must be {what} in [{lo}, {hi}], got {value!r}")
    return value


def one_of(value: Any, key: str, choices: Iterable) -> Any:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"'{key}' must be one of {choices}, got {value!r}")
    return value


def string(value: Any, key: str, what: str = 'a string') -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"'{key}' must be {what}, got {value!r}")
    return value


def typed(section: Mapping, where: str, keys_by_type: Mapping[str, Iterable[str]],
          default: str) -> str:
    """The ``type`` of a section whose keys depend on it (``keys_by_type[type]``, ``type``
    itself allowed), with its keys checked."""
    kind = section.get('type', default)
    if kind not in keys_by_type:
        raise ConfigError(f"'{where}.type' must be one of {sorted(keys_by_type)}, got {kind!r}")
    check_keys(section, set(keys_by_type[kind]) | {'type'}, f'{where}.')
    return kind


def integer_root(n: int, power: int) -> Optional[int]:
    """r with r**power == n, or None."""
    root = round(n ** (1.0 / power))
    for cand in (root - 1, root, root + 1):
        if cand >= 1 and cand ** power == n:
            return cand
    return None
