"""Per-rank memory and step time of ZeRO variants and their peers, world 2 and 4 (gloo, CPU).

    python benchmarks/zero_memory.py [--quick] [--worlds 2,4] [--repeats 3] [--variants a,b,...]

Model: ``GPT.from_preset('tiny', **SHAPE)`` (LM head tied to the token embedding), fp32,
AdamW(lr 1e-4), a local batch of ``BATCH`` sequences of ``SEQ`` tokens per rank, dropout 0.
Each variant runs in its own freshly launched ranks (``run_distributed``: forked ranks,
gloo, one thread each); memory cannot be measured for two engines alive at once, so steps
are not interleaved across variants. Instead the variants alternate over ``--repeats``
rounds: round r runs them in order, round r+1 in reverse. A default run measures
``DEFAULT_VARIANTS`` (our lowest-memory variant and the FSDP2 peers); ``--variants`` picks
any of:

* ``dp``: plain data parallelism (``clt.initialize`` without ``zero``);
* ``zero1`` / ``zero2``: ``zero=dict(stage=1|2)``;
* ``zero3_device`` / ``zero3_cpu`` / ``zero3_auto``: chunk ZeRO,
  ``zero=dict(stage=3, placement=..., chunk_size_mb=chunk_mb)``; ``auto`` with
  ``device_memory_limit`` = half of the unsharded model data (16 B x parameters / 2);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block and on the root of the
  same serial GPT (device mesh 'cpu', the launched gloo group), torch AdamW;
  ``fsdp2_no_reshard``: the same with ``reshard_after_forward=False`` (parameters stay
  gathered from forward to backward: the memory-matched peer of chunk ZeRO's kept chunks);
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

Per variant: the median over repeats of the per-repeat median step time, its run-to-run
spread ((max - min) / median over repeats), and the median peak RSS (max over ranks).
Target (issues 10 and 25): our lowest-memory variant has at most the bytes per parameter,
the peak RSS and the step time of the lowest-memory peer (ratios paired repeat by repeat);
the verdict also says whether the step-time margin ``|1 - ratio|`` is larger than the
run-to-run spread (the larger of the two variants'), i.e. whether it is measurable here.

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
WARMUP, STEPS, REPEATS = 1, 10, 3
VARIANTS = ['dp', 'zero1', 'zero2', 'zero3_device', 'zero3_cpu', 'zero3_auto', 'fsdp2',
            'fsdp2_no_reshard', 'deepspeed_zero2', 'deepspeed_zero3',
            'deepspeed_zero3_torch_gpt']
# what a default run measures (about 25 min here): our lowest-memory variant and its peers
DEFAULT_VARIANTS = ['zero3_device', 'fsdp2', 'fsdp2_no_reshard']
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


def fsdp2(reshard_after_forward=True):
    """FSDP2 on every block and the root; ``reshard_after_forward=False`` keeps each
    block's gathered parameters from forward to backward (no re-gather: ZeRO-2-like
    traffic, more memory -- the memory-matched peer of chunk ZeRO's kept chunks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from model_zoo import GPTLMLoss
    model = build_model()
    mesh = init_device_mesh('cpu', (dist.get_world_size(),))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
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
    'fsdp2_no_reshard': lambda lim, chunk_mb: fsdp2(reshard_after_forward=False),
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
def spread(values) -> float:
    """Run-to-run spread: (max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def summarize_repeat(per_rank, name, params) -> dict:
    """One variant in one repeat: its step times (slowest rank per step) and memory."""
    outs = [r[name] for r in per_rank]
    if 'error' in outs[0]:
        return {'error': outs[0]['error'], 'traceback_tail': outs[0]['traceback_tail']}
    step_s = [max(ts) for ts in zip(*(o['step_s'] for o in outs))]
    return {'median_step_s': statistics.median(step_s), 'step_s_slowest_rank': step_s,
            'bytes_per_param': max(o['model_data_bytes'] for o in outs) / params,
            'peak_rss_bytes': max(o['peak_rss_bytes'] for o in outs),
            'peak_rss_growth_bytes': max(o['peak_rss_growth_bytes'] for o in outs),
            'build_s_rank0': outs[0]['build_s'],
            **{k: outs[0][k] for k in ('ledger', 'chunks', 'chunk_elems', 'hits', 'evictions')
               if k in outs[0]}}


def summarize_variant(repeats) -> dict:
    """Medians over the repeats and their spreads; every repeat kept under ``repeats``."""
    if any('error' in r for r in repeats):
        return next(r for r in repeats if 'error' in r)
    med = {k: statistics.median(r[k] for r in repeats)
           for k in ('median_step_s', 'bytes_per_param', 'peak_rss_bytes', 'peak_rss_growth_bytes')}
    return {**med, 'step_s_spread': spread([r['median_step_s'] for r in repeats]),
            'peak_rss_spread': spread([r['peak_rss_bytes'] for r in repeats]),
            'repeats': repeats}


def paired_ratios(rows, ours, peer) -> dict:
    """Our variant over a peer, repeat by repeat (both ran in the same repeat, back to
    back), on step time and on peak memory; medians, and whether the step-time margin
    ``|1 - ratio|`` exceeds the larger of the two variants' run-to-run spreads."""
    pairs = list(zip(rows[ours]['repeats'], rows[peer]['repeats']))
    step = [a['median_step_s'] / b['median_step_s'] for a, b in pairs]
    peak = [a['peak_rss_bytes'] / b['peak_rss_bytes'] for a, b in pairs]
    growth = [a['peak_rss_growth_bytes'] / b['peak_rss_growth_bytes'] for a, b in pairs]
    noise = max(rows[ours]['step_s_spread'], rows[peer]['step_s_spread'])
    margin = abs(1 - statistics.median(step))
    return {'step_time_ratio': statistics.median(step), 'step_time_ratio_per_repeat': step,
            'peak_rss_ratio': statistics.median(peak), 'peak_rss_ratio_per_repeat': peak,
            'peak_rss_growth_ratio': statistics.median(growth),
            'step_time_margin': margin, 'run_to_run_spread': noise,
            'margin_exceeds_spread': margin > noise}


def target(rows) -> dict:
    """Issue 10/25's target: our lowest-memory variant (the fastest of equal bytes per
    parameter) has at most the bytes per parameter, the peak RSS and the step time of the
    lowest-memory peer (a variant that is not ours); ratios against every peer are listed."""
    ok = [n for n in rows if 'error' not in rows[n]]
    best_ours = min((n for n in ok if n in OURS),
                    key=lambda n: (round(rows[n]['bytes_per_param'], 3), rows[n]['median_step_s']))
    peers = [n for n in ok if n not in OURS]
    best_peer = min(peers, key=lambda n: (round(rows[n]['bytes_per_param'], 3),
                                          rows[n]['peak_rss_bytes']))
    vs = {peer: paired_ratios(rows, best_ours, peer) for peer in peers}
    main = vs[best_peer]
    lowest = rows[best_ours]['bytes_per_param'] <= rows[best_peer]['bytes_per_param'] + 1e-3
    met = lowest and main['step_time_ratio'] <= 1.0 and main['peak_rss_ratio'] <= 1.0
    return {'ours_lowest_memory': best_ours, 'lowest_memory_peer': best_peer,
            'lowest_bytes_per_param': lowest, 'vs': vs, 'met': bool(met),
            'step_time_ratio': main['step_time_ratio'], 'peak_rss_ratio': main['peak_rss_ratio'],
            'margin_exceeds_spread': main['margin_exceeds_spread']}


def run_world(world, variants, repeats, limit, chunk_mb, quick) -> dict:
    """``repeats`` rounds; round r runs the variants in order (reversed every other round),
    each in freshly launched ranks, so nothing of the previous variant stays resident."""
    params, per_variant, orders = None, {n: [] for n in variants}, []
    load0 = load_average()
    for r in range(repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        orders.append(order)
        for name in order:
            per_rank = run_distributed(worker, world, {}, [name], limit, chunk_mb, 1, quick,
                                       timeout=1800, collective_timeout=600)
            params = per_rank[0]['params']
            per_variant[name].append(summarize_repeat(per_rank, name, params))
    rows = {n: summarize_variant(reps) for n, reps in per_variant.items()}
    return {'variants': rows, 'orders': orders, 'target': target(rows),
            'load_average': {'before': load0, 'after': load_average()}}


def print_world(world, res):
    rows = [['world', 'variant', 'B/param', 'step s (median)', 'spread', 'peak RSS MB',
             'RSS growth MB']]
    for name, r in res['variants'].items():
        if 'error' in r:
            rows.append([world, name, 'error', r['error'][:60], '', '', ''])
            continue
        rows.append([world, name, f"{r['bytes_per_param']:.2f}", f"{r['median_step_s']:.3f}",
                     f"{r['step_s_spread']:.1%}", f"{r['peak_rss_bytes'] / 2**20:.0f}",
                     f"{r['peak_rss_growth_bytes'] / 2**20:.0f}"])
    print_table(rows)
    t = res['target']
    for peer, v in t['vs'].items():
        print(f"{t['ours_lowest_memory']} / {peer}: step {v['step_time_ratio']:.3f} "
              f"(margin {v['step_time_margin']:.1%} vs spread {v['run_to_run_spread']:.1%}), "
              f"peak RSS {v['peak_rss_ratio']:.3f}")
    print('target met:', t['met'])


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


def stored_worlds(name, payload) -> float:
    """Copy the stored run's results into ``payload`` (a run of one world size at a time);
    the stored run's settings must match, its variants may differ (each world's results
    name their own). Returns the stored run's total seconds."""
    import json
    with open(os.path.join(RESULTS_DIR, f'{name}.json')) as f:
        stored = json.load(f)
    keys = ('shape', 'timed_steps', 'repeats', 'batch_per_rank', 'seq')
    if any(stored.get(k) != payload[k] for k in keys):
        raise SystemExit(f'--append: the stored run differs in one of {keys}')
    payload['results'].update(stored['results'])
    return stored['total_s']


def main():
    global SHAPE, STEPS
    parser = argparse.ArgumentParser()
    parser.add_argument('--quick', action='store_true', help='tiny model, 1 timed step')
    parser.add_argument('--worlds', default='2,4')
    parser.add_argument('--repeats', type=int, default=REPEATS)
    parser.add_argument('--variants', default=','.join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument('--append', action='store_true',
                        help='keep the other world sizes of the stored results (same settings)')
    args = parser.parse_args()
    if args.quick:
        SHAPE, STEPS = QUICK_SHAPE, 1
    variants = args.variants.split(',')
    from model_zoo import GPT
    numels = [p.numel() for p in GPT.from_preset('tiny', **SHAPE).parameters()]
    params = sum(numels)
    limit = 16 * params // 2
    from colossal_lite.zero.chunk import search_chunk_size
    found = search_chunk_size(numels, dp_sizes=(2, 4), max_elems=CHUNK_MAX_ELEMS)
    chunk_mb = found.capacity * 4 / 2 ** 20
    payload = {'deepspeed_zero_optimization': {s: ds_zero_config(s, chunk_mb) for s in (2, 3)},
               'shape': SHAPE, 'batch_per_rank': BATCH, 'seq': SEQ, 'params': params,
               'chunk_size_mb': chunk_mb, 'chunk_search': repr(found),
               'auto_device_memory_limit_bytes': limit, 'variants': variants,
               'warmup_steps': WARMUP, 'timed_steps': STEPS, 'repeats': args.repeats,
               'dtype': 'fp32', 'environment': environment(), 'results': {}}
    name = 'zero_memory_quick' if args.quick else 'zero_memory'   # --quick never overwrites
    t_start = time.perf_counter() - (stored_worlds(name, payload) if args.append else 0.0)
    for world in (int(w) for w in args.worlds.split(',')):
        res = run_world(world, variants, args.repeats, limit, chunk_mb, args.quick)
        payload['results'][str(world)] = res
        print_world(world, res)
        payload['total_s'] = time.perf_counter() - t_start
        # written after every world size: a run cut short keeps the worlds it finished
        payload['png'] = plot(payload['results'], os.path.join(RESULTS_DIR, f'{name}.png'))
        print('wrote', write_json(name, payload))


if __name__ == '__main__':
    main()
