"""Dynamic loss scale with growth, backoff and hysteresis (Megatron's rule).

State: scale S, growth tracker G (clean steps since the last change), hysteresis
tracker H (overflows still tolerated before backing off), starting at
``S = initial_scale``, ``G = 0``, ``H = hysteresis``. After each step:

* overflow (inf/nan in some rank's gradients; the step is skipped):
  ``G <- 0``; ``H <- H - 1``; if ``H <= 0``: ``S <- max(S * backoff_factor, min_scale)``;
* clean step: ``G <- G + 1``; if ``G == growth_interval``:
  ``G <- 0``; ``H <- hysteresis``; ``S <- min(S * growth_factor, max_scale)``.
"""
from __future__ import annotations

from ..config import ConfigError


class DynamicGradScaler:
    def __init__(self, initial_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 32):
        if not min_scale <= initial_scale <= max_scale:
            raise ConfigError(f"fp16 scales need min_scale <= initial_scale <= max_scale, got "
                              f"{min_scale} <= {initial_scale} <= {max_scale}")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ConfigError(f"fp16 needs growth_factor > 1 and 0 < backoff_factor < 1, got "
                              f"{growth_factor} and {backoff_factor}")
        self.scale = float(initial_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        return {'scale': self.scale, 'growth_tracker': self.growth_tracker,
                'hysteresis_tracker': self.hysteresis_tracker}

    def load_state_dict(self, state: dict):
        self.scale = float(state['scale'])
        self.growth_tracker = int(state['growth_tracker'])
        self.hysteresis_tracker = int(state['hysteresis_tracker'])
