"""Rotary position embedding (RoPE), applied to local q / k activations of any layout.

For head dimension ``d`` and position ``m`` the pair ``(x_i, x_{i + d/2})`` of every head
is rotated by the angle ``m * f_i`` (the "rotate half" convention of GPT-NeoX, Llama and
Hugging Face)::

    f_i = theta^(-2i / d),                      i = 0 .. d/2 - 1
    x'  = x * cos(m f) + rotate_half(x) * sin(m f),   rotate_half(x) = [-x_2, x_1]

Llama-3 rope scaling (``scaling=dict(factor, low_freq_factor, high_freq_factor,
original_max_positions)``) divides the low frequencies by ``factor`` and blends the
middle band: with wavelength ``w_i = 2 pi / f_i``, ``L = original / low_freq_factor``,
``H = original / high_freq_factor``::

    w_i < H          : f_i                        (kept)
    w_i > L          : f_i / factor
    otherwise        : (1 - a) f_i / factor + a f_i,  a = (original / w_i - low) / (high - low)

The rotation acts per head and per position, so it needs only the positions of the
tokens this rank holds (``col_nn.local_positions``) and a local width that is a whole
number of heads -- true in every layout, which never cuts a head. No communication.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Tuple

import torch

SCALING_KEYS = ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_positions')


def check_rope_scaling(scaling: Optional[Mapping]) -> Optional[dict]:
    """``scaling`` as a plain dict with exactly :data:`SCALING_KEYS` (or None); a ValueError
    names a missing or unknown key."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    missing, unknown = set(SCALING_KEYS) - set(scaling), set(scaling) - set(SCALING_KEYS)
    if missing or unknown:
        raise ValueError(f'rope_scaling needs exactly the keys {list(SCALING_KEYS)} (Llama-3 '
                         f'scaling); missing {sorted(missing)}, unknown {sorted(unknown)}')
    if scaling['high_freq_factor'] <= scaling['low_freq_factor']:
        raise ValueError(f"rope_scaling high_freq_factor ({scaling['high_freq_factor']}) must "
                         f"exceed low_freq_factor ({scaling['low_freq_factor']})")
    return scaling


def rope_frequencies(head_dim: int, theta: float = 10000.0,
                     scaling: Optional[Mapping] = None) -> torch.Tensor:
    """The ``d/2`` angular frequencies ``f_i`` (fp32), Llama-3 scaled when ``scaling``."""
    if head_dim % 2:
        raise ValueError(f'rotary embedding needs an even head_dim, got {head_dim}')
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device='cpu').float() / head_dim
    freqs = 1.0 / (theta ** exponents)  # on the CPU even inside a meta build
    scaling = check_rope_scaling(scaling)
    if scaling is None:
        return freqs
    factor, low, high = scaling['factor'], scaling['low_freq_factor'], scaling['high_freq_factor']
    original = scaling['original_max_positions']
    wavelength = 2 * math.pi / freqs
    blend = (original / wavelength - low) / (high - low)
    smoothed = (1 - blend) * freqs / factor + blend * freqs
    return torch.where(wavelength > original / low, freqs / factor,
                       torch.where(wavelength < original / high, freqs, smoothed))


def rotary_tables(positions: torch.Tensor, freqs: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of ``positions [.., s]`` -> ``[.., s, d]`` (each frequency twice: the
    rotate-half layout), computed in fp32 and cast to ``dtype``."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head_dim: int) -> torch.Tensor:
    """Rotate ``x [b, s, n*d]`` (any number of whole local heads) by tables ``[s, d]`` or
    ``[b, s, d]`` (cast to ``x``'s dtype first, as Hugging Face does)."""
    b, s, width = x.shape
    if width % head_dim:
        raise ValueError(f'rotary embedding: local width {width} is not a whole number of '
                         f'heads of {head_dim}')
    heads = x.view(b, s, width // head_dim, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)  # over the heads
    return (heads * cos + rotated * sin).reshape(b, s, width)
