"""Galvatron-BMW's per-layer strategy space, enumerated by its decision-tree rules.

For N devices (a power of two) and each pipeline degree P, the N/P devices of a stage are
split by a decision tree whose levels are distinct paradigms among DP (data), SDP
(sharded data, ZeRO-3) and TP (1D tensor), each level of degree 2, 4, 8, ... (the product
is N/P; the order of levels matters: the outer level spans the larger strides); every tree
is taken with and without activation checkpointing (CKPT). Takeaway #3 drops trees that
mix DP and SDP. For N = 8: 34 trees x 2 = 68 strategies, 22 x 2 = 44 after Takeaway #3
(the paper's counts).

Our runtime's counterpart of a tree is one whole-model layout (``search.candidates``):
DP = data, SDP = ZeRO stage 3, TP = tensor mode '1d' (plus 2D/2.5D/3D/sequence, which
Galvatron lacks), and CKPT is one flag for every block.
"""
from __future__ import annotations

from itertools import permutations
from typing import List, Tuple

PARADIGMS = ('dp', 'sdp', 'tp')
Strategy = Tuple[int, Tuple[Tuple[str, int], ...], bool]   # (P, ((paradigm, degree), ...), ckpt)


def _ordered_factorizations(n: int, parts: int) -> List[Tuple[int, ...]]:
    """Tuples of ``parts`` powers of two >= 2 whose product is n, in every order."""
    if parts == 0:
        return [()] if n == 1 else []
    out = []
    k = 2
    while k <= n:
        if n % k == 0:
            out += [(k,) + rest for rest in _ordered_factorizations(n // k, parts - 1)]
        k *= 2
    return out


def strategies(devices: int, takeaway3: bool = True, checkpoint: bool = True
               ) -> List[Strategy]:
    """Every per-layer strategy of Galvatron-BMW's decision trees on ``devices`` devices."""
    if devices < 1 or devices & (devices - 1):
        raise ValueError(f'Galvatron-BMW enumerates power-of-two device counts, got {devices}')
    out: List[Strategy] = []
    p = 1
    while p <= devices:
        group = devices // p
        trees = [()] if group == 1 else []
        for levels in range(1, len(PARADIGMS) + 1):
            for names in permutations(PARADIGMS, levels):
                if takeaway3 and 'dp' in names and 'sdp' in names:
                    continue
                for degrees in _ordered_factorizations(group, levels):
                    trees.append(tuple(zip(names, degrees)))
        for tree in trees:
            for ckpt in ((False, True) if checkpoint else (False,)):
                out.append((p, tree, ckpt))
        p *= 2
    return out
