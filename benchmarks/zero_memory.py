"""Per-rank memory and step time of ZeRO variants and their peers, world 2 and 4 (gloo, CPU).

    python benchmarks/zero_memory.py [--quick]

Model: ``GPT.from_preset('tiny', **SHAPE)`` (LM head tied to the token embedding), fp32,
AdamW(lr 1e-4), a local batch of ``BATCH`` sequences of ``SEQ`` tokens per rank, dropout 0.
Each variant runs in its own launched ranks (``run_distributed``: forked ranks, gloo, one
thread each), one variant after the other (memory cannot be measured for two engines alive
at once, so steps are not interleaved across variants; the order is reversed at the second
world size):

* ``dp``: plain data parallelism (``clt.initialize`` without ``zero``);
* ``zero1`` / ``zero2``: ``zero=dict(stage=1|2)``;
* ``zero3_device`` / ``zero3_cpu`` / ``zero3_auto``: chunk ZeRO,
  ``zero=dict(stage=3, placement=..., chunk_size_mb=chunk_mb)``; ``auto`` with
  ``device_memory_limit`` = half of the unsharded model data (16 B x parameters / 2);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block and on the root of the
  same serial GPT (device mesh 'cpu', the launched gloo group), torch AdamW;
* ``deepspeed_zero2`` / ``deepspeed_zero3``: ``deepspeed.initialize`` (``DS_ACCELERATOR=cpu``)
  with the same model and a torch AdamW; a failure is recorded with its exception;
  ``deepspeed_zero3_torch_gpt``: ZeRO-3 on ``TorchGPT``, a plain torch GPT of the same shape
  and parameter count (ours refuses ZeRO-3's input-replacing forward pre-hooks).

Per variant and rank, after ``WARMUP`` steps, ``STEPS`` timed steps (a barrier before each;
a step's time is the slowest rank's; the median is reported):

* ``model_data_bytes``: bytes of every live tensor storage (each storage once, found through
  ``gc`` after ``gc.collect()``; DTensors through their local tensor) at the end of a step (after the optimizer's
  step, gradients still held where the variant keeps them), minus those alive before the
  variant was built: parameters + gradients + optimizer states + masters + chunk buffers,
  counted the same way for every variant; ``bytes_per_param`` = that / parameter count.
* ``peak_rss_growth_bytes``: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end of a
  step minus the RSS at its start, the peak reset right before the step
  (``/proc/self/clear_refs`` 5: it resets the ``ru_maxrss`` that getrusage reads) after a
  ``malloc_trim``; median over the timed steps. ``peak_rss_bytes``: the absolute peak.
* chunk ZeRO: the manager's device ledger (``peak`` accounted bytes, H2D/D2H moved).

Ratios: each variant's step time over the step time of the variant with the next-lowest
``model_data_bytes``; the target (issue 10): our lowest-memory variant has the lowest bytes
per parameter of all and at most 1.0x the step time of the next-lowest peer.

Writes ``results/zero_memory.json`` and ``results/zero_memory.png`` (``--quick``: a tiny
model, one timed step, into ``results/zero_memory_quick.*``).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import RESULTS_DIR, environment, load_average, print_table, write_json  # noqa: E402,E501
from benchmarks._memory import live_tensor_bytes, peak_rss, reset_peak, rss_bytes  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402

# ~152M parameters (GPT-2 small's vocabulary and width, 16 blocks): about the largest GPT
# whose plain data-parallel baseline (16 B/param + activations, 4 ranks) fits in 24 GiB
SHAPE = dict(vocab_size=50304, max_positions=128, hidden=768, layers=16, heads=12, dropout=0.0)
QUICK_SHAPE = dict(vocab_size=1024, max_positions=64, hidden=128, layers=2, heads=4, dropout=0.0)
BATCH, SEQ = 2, 64
CHUNK_MAX_ELEMS = 8 * 2 ** 20       # the chunk-size search's bound (32 MB fp32 chunks)
WARMUP, STEPS = 1, 3
VARIANTS = ['dp', 'zero1', 'zero2', 'zero3_device', 'zero3_cpu', 'zero3_auto', 'fsdp2',
            'deepspeed_zero2', 'deepspeed_zero3', 'deepspeed_zero3_torch_gpt']
OURS = ['zero1', 'zero2', 'zero3_device', 'zero3_cpu', 'zero3_auto']

# ------------------------------------------------------------------ variants
def build_model():
    from model_zoo import GPT
    torch.manual_seed(0)
    return GPT.from_preset('tiny', **SHAPE)


class TorchGPT(torch.nn.Module):
    """A plain torch GPT-2 of ``SHAPE`` (pre-LN blocks, separate q/k/v projections, tanh-GELU
    MLP x4, LM head tied to the token embedding): the same parameter count as ours, for
    peers that cannot wrap ours (DeepSpeed ZeRO-3's input-replacing forward pre-hooks)."""

    def __init__(self, vocab_size, max_positions, hidden, layers, heads, dropout=0.0):
        super().__init__()
        nn = torch.nn
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab_size, hidden), nn.Embedding(max_positions, hidden)
        self.blocks = nn.ModuleDict({str(i): nn.ModuleDict(dict(
            ln1=nn.LayerNorm(hidden), query=nn.Linear(hidden, hidden), key=nn.Linear(hidden, hidden),
            value=nn.Linear(hidden, hidden), out=nn.Linear(hidden, hidden), ln2=nn.LayerNorm(hidden),
            fc1=nn.Linear(hidden, 4 * hidden), fc2=nn.Linear(4 * hidden, hidden)))
            for i in range(layers)})
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        b, s = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(s))
        split = lambda t: t.view(b, s, self.heads, -1).transpose(1, 2)  # noqa: E731
        for blk in self.blocks.values():
            h = blk['ln1'](x)
            a = torch.nn.functional.scaled_dot_product_attention(
                split(blk['query'](h)), split(blk['key'](h)), split(blk['value'](h)), is_causal=True)
            x = x + blk['out'](a.transpose(1, 2).reshape(b, s, -1))
            x = x + blk['fc2'](torch.nn.functional.gelu(blk['fc1'](blk['ln2'](x)),
                                                        approximate='tanh'))
        return self.lm_head(self.ln_f(x))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def ours(zero):
    import colossal_lite as clt
    from model_zoo import GPTLMLoss
    model = build_model()
    config = {} if zero is None else dict(zero=zero)
    engine, *_ = clt.initialize(model, adamw(model.parameters()), GPTLMLoss(), config=config)

    def step(batch):
        engine.zero_grad()
        engine.execute_schedule(batch)
        assert engine.step()

    def info():
        manager = getattr(engine.optimizer, 'manager', None)
        if manager is None:
            return {}
        policy = manager.policy
        return {'ledger': manager.ledger.stats(), 'chunks': len(manager.chunks),
                'chunk_elems': manager.chunks[0].padded_numel,
                'hits': getattr(policy, 'hits', None),
                'evictions': getattr(policy, 'evictions', None)}
    return step, info


def fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from model_zoo import GPTLMLoss
    model = build_model()
    mesh = init_device_mesh('cpu', (dist.get_world_size(),))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, loss_fn = adamw(model.parameters()), GPTLMLoss()

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batch[0]), batch[1]).backward()
        opt.step()
    return step, dict


def ds_zero_config(stage, chunk_mb):
    """DeepSpeed's defaults, but its buckets the size of our chunks (its default
    ``reduce_bucket_size`` of 5e8 elements would allocate 2 GB per rank)."""
    elems = int(chunk_mb * 2 ** 20 / 4)
    cfg = {'stage': stage, 'reduce_bucket_size': elems, 'allgather_bucket_size': elems}
    if stage == 3:
        cfg['stage3_prefetch_bucket_size'] = elems
    return cfg


def deepspeed_zero(stage, chunk_mb, plain=False):
    os.environ.setdefault('DS_ACCELERATOR', 'cpu')
    for key, value in (('LOCAL_RANK', dist.get_rank()), ('RANK', dist.get_rank()),
                       ('WORLD_SIZE', dist.get_world_size())):
        os.environ[key] = str(value)
    import deepspeed
    from model_zoo import GPTLMLoss
    torch.manual_seed(0)
    model = TorchGPT(**SHAPE) if plain else build_model()
    cfg = {'train_micro_batch_size_per_gpu': BATCH, 'gradient_accumulation_steps': 1,
           'zero_optimization': ds_zero_config(stage, chunk_mb), 'steps_per_print': 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()),
                                      config=cfg, dist_init_required=False)
    loss_fn = GPTLMLoss()

    def step(batch):
        loss = loss_fn(engine(batch[0]), batch[1])
        engine.backward(loss)
        engine.step()
    return step, dict


BUILDERS = {
    'dp': lambda lim, chunk_mb: ours(None),
    'zero1': lambda lim, chunk_mb: ours(dict(stage=1)),
    'zero2': lambda lim, chunk_mb: ours(dict(stage=2)),
    'zero3_device': lambda lim, chunk_mb: ours(dict(stage=3, placement='device', chunk_size_mb=chunk_mb)),
    'zero3_cpu': lambda lim, chunk_mb: ours(dict(stage=3, placement='cpu', chunk_size_mb=chunk_mb)),
    'zero3_auto': lambda lim, chunk_mb: ours(dict(stage=3, placement='auto', chunk_size_mb=chunk_mb,
                                        device_memory_limit=lim)),
    'fsdp2': lambda lim, chunk_mb: fsdp2(),
    'deepspeed_zero2': lambda lim, chunk_mb: deepspeed_zero(2, chunk_mb),
    'deepspeed_zero3': lambda lim, chunk_mb: deepspeed_zero(3, chunk_mb),
    'deepspeed_zero3_torch_gpt': lambda lim, chunk_mb: deepspeed_zero(3, chunk_mb, plain=True),
}


def measure(name, batch, limit, chunk_mb) -> dict:
    base = live_tensor_bytes()
    t0 = time.perf_counter()
    step, info = BUILDERS[name](limit, chunk_mb)
    build_s = time.perf_counter() - t0
    for _ in range(WARMUP):
        step(batch)
    times, growth, peaks, data = [], [], [], []
    for _ in range(STEPS):
        reset_peak()
        before = rss_bytes()
        dist.barrier()
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
        peaks.append(peak_rss())
        growth.append(peaks[-1] - before)
        data.append(live_tensor_bytes() - base)
    return {'step_s': times, 'peak_rss_growth_bytes': statistics.median(growth),
            'peak_rss_bytes': max(peaks), 'model_data_bytes': max(data),
            'build_s': build_s, **info()}


def worker(rank, order, limit, chunk_mb, seed, quick=False):
    global SHAPE, STEPS
    if quick:   # main()'s --quick: a rank is not a fork of main's process, it sets its own
        SHAPE, STEPS = QUICK_SHAPE, 1
    torch.manual_seed(seed + rank)
    ids = torch.randint(0, SHAPE['vocab_size'], (BATCH, SEQ))
    out = {'params': sum(p.numel() for p in build_model().parameters())}
    for name in order:
        gc.collect()
        try:
            out[name] = measure(name, (ids, ids), limit, chunk_mb)
        except Exception as exc:  # noqa: BLE001 -- recorded: a peer that does not run here
            out[name] = {'error': f'{type(exc).__name__}: {exc}'[:1500],
                         'traceback_tail': traceback.format_exc()[-1500:]}
        gc.collect()
        dist.barrier()
    return out


# ------------------------------------------------------------------ summary
def summarize(per_rank, order, params) -> dict:
    rows = {}
    for name in order:
        outs = [r[name] for r in per_rank]
        if 'error' in outs[0]:
            rows[name] = {'error': outs[0]['error'], 'traceback_tail': outs[0]['traceback_tail']}
            continue
        step_s = [max(ts) for ts in zip(*(o['step_s'] for o in outs))]
        rank0 = outs[0]
        rows[name] = {
            'median_step_s': statistics.median(step_s), 'step_s_slowest_rank': step_s,
            'model_data_bytes_per_rank': [o['model_data_bytes'] for o in outs],
            'bytes_per_param': max(o['model_data_bytes'] for o in outs) / params,
            'peak_rss_growth_bytes_per_rank': [o['peak_rss_growth_bytes'] for o in outs],
            'peak_rss_bytes_per_rank': [o['peak_rss_bytes'] for o in outs],
            'build_s_rank0': rank0['build_s'],
            **{k: rank0[k] for k in ('ledger', 'chunks', 'chunk_elems', 'hits', 'evictions')
               if k in rank0}}
    ok = sorted((n for n in rows if 'error' not in rows[n]),
                key=lambda n: rows[n]['bytes_per_param'])
    for lower, higher in zip(ok, ok[1:]):
        rows[lower]['next_lowest_memory_peer'] = higher
        rows[lower]['step_time_ratio_vs_next_lowest'] = (rows[lower]['median_step_s']
                                                         / rows[higher]['median_step_s'])
    return {'variants': rows, 'memory_order': ok, 'target': target(rows, ok)}


def target(rows, ok) -> dict:
    """Issue 10's target: our lowest-memory variant (the fastest of equal bytes per parameter)
    against the lowest-memory peer (a variant that is not ours: FSDP2, DeepSpeed, plain dp)."""
    best_ours = min((n for n in ok if n in OURS),
                    key=lambda n: (round(rows[n]['bytes_per_param'], 3), rows[n]['median_step_s']))
    best_peer = min((n for n in ok if n not in OURS), key=lambda n: rows[n]['bytes_per_param'])
    ratio = rows[best_ours]['median_step_s'] / rows[best_peer]['median_step_s']
    lowest = rows[best_ours]['bytes_per_param'] <= rows[best_peer]['bytes_per_param']
    return {'ours_lowest_memory': best_ours, 'next_lowest_memory_peer': best_peer,
            'bytes_per_param': {best_ours: rows[best_ours]['bytes_per_param'],
                                best_peer: rows[best_peer]['bytes_per_param']},
            'step_time_ratio': ratio, 'lowest_bytes_per_param': lowest,
            'met': bool(lowest and ratio <= 1.0)}


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (world, res) in zip(axes[0], results.items()):
        for name, row in res['variants'].items():
            if 'error' in row:
                continue
            ax.scatter(row['bytes_per_param'], row['median_step_s'])
            ax.annotate(name, (row['bytes_per_param'], row['median_step_s']), fontsize=8)
        ax.set_xlabel('model-data bytes per parameter (per rank)')
        ax.set_ylabel('median step time (s)')
        ax.set_title(f'world {world}')
    fig.tight_layout()
    fig.savefig(path)
    return path


def main():
    global SHAPE, STEPS
    parser = argparse.ArgumentParser()
    parser.add_argument('--quick', action='store_true', help='tiny model, 1 timed step')
    parser.add_argument('--worlds', default='2,4')
    args = parser.parse_args()
    if args.quick:
        SHAPE, STEPS = QUICK_SHAPE, 1
    from model_zoo import GPT
    params = sum(p.numel() for p in GPT.from_preset('tiny', **SHAPE).parameters())
    limit = 16 * params // 2
    from colossal_lite.zero.chunk import search_chunk_size
    numels = [p.numel() for p in GPT.from_preset('tiny', **SHAPE).parameters()]
    found = search_chunk_size(numels, dp_sizes=(2, 4), max_elems=CHUNK_MAX_ELEMS)
    chunk_mb = found.capacity * 4 / 2 ** 20
    payload = {'deepspeed_zero_optimization': {s: ds_zero_config(s, chunk_mb) for s in (2, 3)},
               'shape': SHAPE, 'batch_per_rank': BATCH, 'seq': SEQ, 'params': params,
               'chunk_size_mb': chunk_mb, 'chunk_search': repr(found), 'auto_device_memory_limit_bytes': limit,
               'warmup_steps': WARMUP, 'timed_steps': STEPS, 'dtype': 'fp32',
               'environment': environment(), 'results': {}, 'load_average_during': {}}
    t_start = time.perf_counter()
    for i, world in enumerate(int(w) for w in args.worlds.split(',')):
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
        load0 = load_average()
        per_rank = [{} for _ in range(world)]
        for name in order:  # each variant in fresh ranks: nothing of the last one stays resident
            for mine, got in zip(per_rank, run_distributed(
                    worker, world, {}, [name], limit, chunk_mb, 1, args.quick, timeout=1800,
                    collective_timeout=600)):
                mine.update(got)
        payload['load_average_during'][world] = {'before': load0, 'after': load_average()}
        res = summarize(per_rank, order, params)
        res['order'] = order
        payload['results'][world] = res
        rows = [['world', 'variant', 'B/param', 'step s', 'ratio vs next', 'RSS growth MB']]
        for name in res['memory_order']:
            r = res['variants'][name]
            rows.append([world, name, f"{r['bytes_per_param']:.2f}", f"{r['median_step_s']:.3f}",
                         f"{r.get('step_time_ratio_vs_next_lowest', float('nan')):.2f}",
                         f"{max(r['peak_rss_growth_bytes_per_rank']) / 2**20:.0f}"])
        for name, r in res['variants'].items():
            if 'error' in r:
                rows.append([world, name, 'error', r['error'][:60], '', ''])
        print_table(rows)
        print('target:', res['target'])
    payload['total_s'] = time.perf_counter() - t_start
    name = 'zero_memory_quick' if args.quick else 'zero_memory'   # --quick never overwrites
    payload['png'] = plot(payload['results'], os.path.join(RESULTS_DIR, f'{name}.png'))
    print('wrote', write_json(name, payload))


if __name__ == '__main__':
    main()
