"""Peak memory of a resharded checkpoint load: does ``checkpoint.load`` stay within the
rank's local shards plus the largest single tensor?

A GPT (hidden 512, 4 layers, vocabulary 8192: 17 M parameters, 204 MB with its AdamW
state) is trained one step and saved under 1D tensor parallel tp=2; then, in freshly
forked processes, a fresh engine of each target layout (no optimizer state yet, as in a
resume) loads it. Per rank: the RSS growth from just before ``load`` to its peak during
``load`` (the kernel's high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs``
right before the call), against

* ``new``: the bytes the load brings into being on the rank -- its Adam slots
  (``exp_avg``, ``exp_avg_sq``, ``step``); the parameter shards existed before the call and
  are loaded in place, so they are in the RSS before ``load`` and not in the delta;
* ``largest``: the largest single tensor of the checkpoint at its full shape.

``ratio = peak delta / (new + largest)``; <= 1 means the load stays in budget. Numerator and
denominator count the same things: what did not exist before the call (the new slots, DCP's
targets and read buffers). The parameter bytes are recorded too (``param_bytes``).
Run: ``python benchmarks/checkpoint_load_memory.py``; writes
``benchmarks/results/checkpoint_load_memory.json``.
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

MODEL = dict(hidden=512, layers=4, heads=8, vocab_size=8192, max_positions=256, dropout=0.0)
SAVE = ('tp=2 (1d)', 2, dict(parallel=dict(tensor=dict(size=2, mode='1d'))))
LOADS = [
    ('tp=2 (1d), same layout', 2, dict(parallel=dict(tensor=dict(size=2, mode='1d')))),
    ('pp=2', 2, dict(parallel=dict(pipeline=2), num_microbatches=2)),
    ('2D q=2', 4, dict(parallel=dict(tensor=dict(size=4, mode='2d')))),
    ('serial', 1, {}),
]


def _engine():
    import colossal_lite as clt
    from model_zoo import GPT, GPTLMLoss
    model = GPT.from_preset('tiny', **MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = clt.initialize(model, optimizer, GPTLMLoss())
    return engine


def _train_and_save(rank, path):
    from colossal_lite import checkpoint
    from colossal_lite.testing import engine_step, replica_batch
    engine = _engine()
    ids = torch.randint(0, MODEL['vocab_size'], (4, 64), generator=torch.Generator().manual_seed(0))
    engine_step(engine, replica_batch((ids, ids)))
    checkpoint.save(path, engine)


def _kib(field: str) -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'no {field} in /proc/self/status')


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _load_peak(rank, path):
    from colossal_lite import checkpoint
    engine = _engine()
    gc.collect()
    before = _kib('VmRSS')
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')                                 # reset VmHWM to the current RSS
    checkpoint.load(path, engine)
    peak = _kib('VmHWM')
    params = sum(_tensor_bytes(p) for p in engine.model.parameters())
    slots = sum(_tensor_bytes(v) for state in engine.optimizer.state.values()
                for v in state.values())
    return dict(rank=rank, delta=(peak - before) * 1024, new=slots, param_bytes=params)


def _largest(path) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return max(m.size.numel() * m.properties.dtype.itemsize for m in meta.values()
               if isinstance(m, TensorStorageMetadata))


def main():
    from _common import environment, print_table, write_json
    from colossal_lite.testing import run_distributed
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, 'ckpt')
        run_distributed(_train_and_save, SAVE[1], SAVE[2], path, timeout=600)
        largest = _largest(path)
        saved = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        rows, cases = [['load into', 'rank', 'peak delta MB', 'new MB', 'largest MB',
                        'ratio']], []
        for name, world, cfg in LOADS:
            for r in run_distributed(_load_peak, world, cfg, path, timeout=600):
                ratio = r['delta'] / (r['new'] + largest)
                cases.append(dict(load_into=name, world=world, largest=largest, ratio=ratio, **r))
                rows.append([name, str(r['rank']), f"{r['delta'] / 1e6:.1f}",
                             f"{r['new'] / 1e6:.1f}", f'{largest / 1e6:.1f}', f'{ratio:.2f}'])
    print(f'saved under {SAVE[0]}: {saved / 1e6:.1f} MB on disk')
    print_table(rows)
    out = write_json('checkpoint_load_memory', dict(
        model=MODEL, saved_under=SAVE[0], checkpoint_bytes=saved, cases=cases,
        max_ratio=max(c['ratio'] for c in cases), environment=environment()))
    print(f'max ratio {max(c["ratio"] for c in cases):.2f}; wrote {out}')


if __name__ == '__main__':
    main()
