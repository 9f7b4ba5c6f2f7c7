"""``ParallelMode`` lives on the ground floor (``config/modes.py``); this name stays for users."""
from ..config.modes import ParallelMode

__all__ = ['ParallelMode']
