"""Bytes per rank of one training step (forward + backward) of a ViT block, per tensor mode.

Measured with ``comm_profile`` on 4 and 8 local gloo ranks for every available mode
(1D; 2D; 2.5D; 3D when ``colossal_lite.nn.parallel_3d`` exists), printed next to the
closed-form count derived from the per-layer formulas of docs/tensor_parallel.md and
docs/tensor_parallel.md, 3D section, and that formula extrapolated to 64 ranks.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/tp_comm.py`` -> benchmarks/results/tp_comm.json
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, print_table, write_json  # noqa: E402
from colossal_lite.communication import comm_profile  # noqa: E402
from colossal_lite.context import global_context as gpc  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402
from model_zoo.blocks import TransformerLayer  # noqa: E402

B, S, H, HEADS, MLP = 16, 16, 64, 8, 4
ELEM = 4
HAS_3D = importlib.util.find_spec('colossal_lite.nn.parallel_3d') is not None


def block_bytes(mode: str, b: int, s: int, h: int, p: int, d: int = 1) -> float:
    """Bytes per rank of one block, forward + backward: ``colossal_lite.formulas.block_bytes``
    (the per-layer formulas of docs/tensor_parallel.md summed over the block)."""
    from colossal_lite.formulas import block_bytes as formula
    return formula(mode, p, b, s, h, mlp_ratio=MLP, d=d, elem=ELEM)


def _local_input(mode, x):
    if mode in ('2d', '2.5d'):
        from colossal_lite.nn.parallel_2p5d import Grid2p5D
        return Grid2p5D.current().split_activation(x)
    if mode == '3d':
        from colossal_lite.nn.parallel_3d import Cube3D, split_activation
        return split_activation(x, Cube3D.from_context().standard)
    return x


def _measure(rank, mode):
    torch.manual_seed(0)
    block = TransformerLayer(H, HEADS, MLP, dropout=0.0, pre_ln=True)
    x = _local_input(mode, torch.randn(B, S, H)).requires_grad_(True)
    block(x).sum().backward()  # warm-up (lazy set-up must not be counted)
    block.zero_grad()
    with comm_profile() as stats:
        block(x).sum().backward()
    return {'bytes': stats.bytes(), 'wire_bytes': stats.wire_bytes(), 'calls': stats.calls(),
            'by_mode': stats.by_mode(), 'tensor_mode': gpc.tensor_mode}


def configs():
    out = [('1d', 4, 1), ('2d', 4, 1), ('2.5d', 4, 1), ('1d', 8, 1), ('2.5d', 8, 2)]
    if HAS_3D:
        out.append(('3d', 8, 1))
    return out


def _config(mode, p, d):
    tensor = dict(size=p, mode=mode)
    if mode == '2.5d':
        tensor['depth'] = d
    return dict(parallel=dict(tensor=tensor))


def main():
    rows = [['mode', 'ranks', 'depth', 'measured bytes/rank', 'formula', 'wire bytes/rank',
             'calls', 'formula @64 ranks']]
    records = []
    extrapolate = {'1d': ('1d', 64, 1), '2d': ('2d', 64, 1), '2.5d': ('2.5d', 64, 4),
                   '3d': ('3d', 64, 1)}
    for mode, p, d in configs():
        results = run_distributed(_measure, p, _config(mode, p, d), mode, timeout=600)
        per_rank = sorted({r['bytes'] for r in results})
        formula = block_bytes(mode, B, S, H, p, d)
        m64, p64, d64 = extrapolate[mode]
        at64 = block_bytes(m64, B, S, H, p64, d64)
        vit_base_64 = block_bytes(m64, 64, 197, 768, p64, d64)
        records.append(dict(mode=mode, ranks=p, depth=d, measured_bytes_per_rank=per_rank,
                            formula_bytes=formula, matches=per_rank == [formula],
                            wire_bytes_per_rank=max(r['wire_bytes'] for r in results),
                            calls=results[0]['calls'], by_group=results[0]['by_mode'],
                            formula_64_ranks=dict(depth=d64, this_shape=at64,
                                                  vit_base_b64=vit_base_64)))
        rows.append([mode, p, d, per_rank if len(per_rank) > 1 else per_rank[0], int(formula),
                     int(records[-1]['wire_bytes_per_rank']), results[0]['calls'], int(at64)])
    print(f'ViT block b={B} s={S} h={H} heads={HEADS} mlp={MLP}h, fp32, forward+backward')
    print_table(rows)
    print('64 ranks, ViT-base block (b=64, s=197, h=768), formula bytes/rank:')
    for rec in {r['mode']: r for r in records}.values():
        print(f"  {rec['mode']:>5}: {rec['formula_64_ranks']['vit_base_b64'] / 2**20:9.1f} MiB"
              f" (depth {rec['formula_64_ranks']['depth']})")
    path = write_json('tp_comm', dict(shape=dict(b=B, s=S, h=H, heads=HEADS, mlp_ratio=MLP),
                                      units='bytes per rank, buffer measure of comm_profile',
                                      results=records, environment=environment()))
    print('wrote', path)
    return records


if __name__ == '__main__':
    main()
