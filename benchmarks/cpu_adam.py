"""CPU Adam step on 50M parameters: our fused kernel vs torch's fused AdamW (+ unscale and
copy-out) vs DeepSpeedCPUAdam, and our achieved memory bandwidth vs a STREAM-style copy.

Scenarios (each timed side by side, alternated round by round, medians of the repeats):

* ``mixed_fp16`` / ``mixed_bf16``: the mixed-precision optimizer step of ZeRO-offload. Inputs
  are the fp32 master, fp32 moments and the loss-scaled fp16/bf16 gradient; outputs the
  updated master and moments and the fp16/bf16 parameter copy; a gradient with inf/nan must
  be found. ``ours``: one ``adam_step(..., loss_scale, out_lowp)`` call (inf/nan scan, then
  one fused pass). ``torch``: grad copied to an fp32 buffer, ``_amp_foreach_non_finite_check_
  and_unscale_`` (GradScaler's check + unscale), ``AdamW(fused=True).step()``, copy-out.
  ``deepspeed``: the same pre/post around ``DeepSpeedCPUAdam.step()`` (its op takes a
  gradient of the parameter's dtype and neither unscales nor copies out).
* ``fp32``: the bare step, fp32 gradient, no scaling, no check, no copy-out: ours
  (``check_finite=False``) vs ``AdamW(fused=True)`` vs ``DeepSpeedCPUAdam``.
* ``stream_copy`` (``b.copy_(a)``) and ``stream_triad`` (``a = b + s * c``) over 50M fp32
  elements, alternated with the others: the bandwidth this machine gives in the same run
  (STREAM's counting: bytes read + bytes written, no write-allocate traffic).

Run (deepspeed is not a dependency; it builds its CPU Adam op on first use, ~2 min):

    DS_BUILD_OPS=0 pip install deepspeed     # optional: the DeepSpeed column
    python benchmarks/cpu_adam.py [--params 50000000 --threads 1,2 --repeats 7 --steps 2]

Writes benchmarks/results/cpu_adam.json and prints a table. If DeepSpeed cannot be imported,
built or run, the exact error is recorded in its place.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import environment, print_table, time_alternated, write_json  # noqa: E402
from colossal_lite.nn.optimizer import active_backend, adam_step  # noqa: E402

LR, BETAS, EPS, WD, SCALE = 1e-3, (0.9, 0.999), 1e-8, 0.01, 1024.0
LOWP = {'mixed_fp16': torch.float16, 'mixed_bf16': torch.bfloat16}


def bytes_per_param(scenario: str) -> dict:
    """Bytes each implementation reads + writes per parameter (STREAM counting)."""
    if scenario == 'fp32':  # p, g, m, v read; p, m, v written
        core = 16 + 12
        return {'ours': core, 'torch': core, 'deepspeed': core}
    lp = 2
    ours = (4 + lp + 4 + 4) + (4 + 4 + 4 + lp) + lp  # fused pass + the inf/nan scan of g
    pre_post = (lp + 4) + (4 + 4) + (4 + lp)  # grad -> fp32, check+unscale, copy-out
    return {'ours': ours, 'torch': 28 + pre_post, 'deepspeed': 28 + pre_post}


def _deepspeed():
    """(DeepSpeedCPUAdam class, None) or (None, the exact reason it is unavailable)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = torch.nn.Parameter(torch.zeros(8))
        opt = DeepSpeedCPUAdam([probe], lr=LR)
        probe.grad = torch.ones(8)
        opt.step()  # builds the op (JIT) on first use
        return DeepSpeedCPUAdam, None
    except BaseException as exc:  # SystemExit from a failed build included
        return None, ''.join(traceback.format_exception_only(type(exc), exc)).strip()


def _fp32_state(n, gen):
    return (torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n))


def build_runs(scenario: str, n: int, ds_cls):
    """name -> callable doing one optimizer step (or one STREAM kernel)."""
    gen = torch.Generator().manual_seed(0)
    lowp = LOWP.get(scenario)
    grad_dtype = lowp or torch.float32
    grad = (torch.randn(n, generator=gen) * (SCALE if lowp else 1.0)).to(grad_dtype)
    runs = {}

    master, m, v = _fp32_state(n, gen)
    out = torch.empty(n, dtype=lowp) if lowp else None
    step = [0]

    def ours():
        step[0] += 1
        found = adam_step(master, grad, m, v, step[0], LR, *BETAS, EPS, WD, True,
                          loss_scale=SCALE if lowp else 1.0, out_lowp=out,
                          check_finite=lowp is not None)
        assert not found
    runs['ours'] = ours

    def torch_like(opt_factory):
        p = torch.nn.Parameter(torch.randn(n, generator=gen))
        p.grad = torch.zeros(n)
        opt = opt_factory([p])
        lowp_out = torch.empty(n, dtype=lowp) if lowp else None
        found_inf, inv_scale = torch.zeros(1), torch.full((1,), 1.0 / SCALE)

        def run():
            if lowp is not None:
                p.grad.copy_(grad)
                torch._amp_foreach_non_finite_check_and_unscale_([p.grad], found_inf, inv_scale)
                assert found_inf.item() == 0
            else:
                p.grad = grad
            opt.step()
            if lowp_out is not None:
                lowp_out.copy_(p.detach())
        return run

    runs['torch'] = torch_like(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS,
                                                            weight_decay=WD, fused=True))
    if ds_cls is not None:
        runs['deepspeed'] = torch_like(lambda ps: ds_cls(ps, lr=LR, betas=BETAS, eps=EPS,
                                                         weight_decay=WD, adamw_mode=True))
    a, b, c = torch.randn(n, generator=gen), torch.empty(n), torch.randn(n, generator=gen)
    runs['stream_copy'] = lambda: b.copy_(a)
    runs['stream_triad'] = lambda: torch.add(a, c, alpha=3.0, out=b)
    d = torch.zeros(n)
    runs['stream_add_inplace'] = lambda: d.add_(c, alpha=1e-30)
    return runs


# bytes counted per element; stream_add_inplace (d += c) reads and writes d in place, as the
# Adam pass does p, m and v, so it pays no write-allocate reads (copy and triad do)
STREAM_BYTES = {'stream_copy': 8, 'stream_triad': 12, 'stream_add_inplace': 12}


def measure(scenario, n, threads, ds_cls, repeats, steps):
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    runs = build_runs(scenario, n, ds_cls)
    cpu = {}
    wall = time_alternated(runs, repeats=repeats, steps=steps, warmup=1, cpu_times=cpu)
    med = {k: statistics.median(t) for k, t in wall.items()}
    bpp = bytes_per_param(scenario)
    gbps = {k: bpp[k] * n / med[k] / 1e9 for k in bpp if k in med}
    gbps.update({k: STREAM_BYTES[k] * n / med[k] / 1e9 for k in STREAM_BYTES})
    ratios = {}
    for peer in ('torch', 'deepspeed'):
        if peer in wall:
            ratios[f'ours_over_{peer}'] = statistics.median(
                a / b for a, b in zip(wall['ours'], wall[peer]))
    ratios['ours_bandwidth_over_copy'] = statistics.median(
        (bpp['ours'] / a) / (STREAM_BYTES['stream_copy'] / b)
        for a, b in zip(wall['ours'], wall['stream_copy']))
    for ref in ('stream_triad', 'stream_add_inplace'):
        ratios[f'ours_bandwidth_over_{ref[7:]}'] = statistics.median(
            (bpp['ours'] / a) / (STREAM_BYTES[ref] / b) for a, b in zip(wall['ours'], wall[ref]))
    for peer in ('torch', 'deepspeed'):
        if peer in cpu:
            ratios[f'ours_over_{peer}_cpu_time'] = statistics.median(
                a / b for a, b in zip(cpu['ours'], cpu[peer]))
    return {'threads': threads, 'scenario': scenario, 'median_s_per_step': med,
            'cpu_s_per_step_median': {k: statistics.median(t) for k, t in cpu.items()},
            'wall_s_per_step': wall, 'bytes_per_param': bpp, 'achieved_GBps': gbps,
            'ratios': ratios, 'load_average_before': list(load_before),
            'load_average_after': list(os.getloadavg())}


# the targets; the last line is the same bandwidth bound against the in-place add,
# the stricter reference for a kernel that mostly updates its arrays in place
TARGETS = {'ours_over_torch': ('<=', 0.85), 'ours_over_deepspeed': ('<=', 0.9),
           'ours_bandwidth_over_copy': ('>=', 0.85),
           'ours_bandwidth_over_add_inplace': ('>=', 0.85)}


def verdicts(ratios: dict) -> dict:
    out = {}
    for key, (op, bound) in TARGETS.items():
        if key in ratios:
            r = ratios[key]
            out[key] = bool(r <= bound if op == '<=' else r >= bound)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--params', type=int, default=50_000_000)
    ap.add_argument('--threads', default='1,2')
    ap.add_argument('--scenarios', default='mixed_fp16,mixed_bf16,fp32')
    ap.add_argument('--repeats', type=int, default=7)
    ap.add_argument('--steps', type=int, default=2)
    ap.add_argument('--no-deepspeed', action='store_true')
    args = ap.parse_args()
    ds_cls, ds_error = (None, 'skipped (--no-deepspeed)') if args.no_deepspeed else _deepspeed()
    results = []
    for threads in [int(t) for t in args.threads.split(',')]:
        for scenario in args.scenarios.split(','):
            r = measure(scenario, args.params, threads, ds_cls, args.repeats, args.steps)
            r['meets_targets'] = verdicts(r['ratios'])
            results.append(r)
    payload = {'params': args.params, 'repeats': args.repeats, 'steps_per_repeat': args.steps,
               'simd_path': active_backend(), 'hyperparameters': dict(
                   lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, loss_scale=SCALE, adamw=True),
               'deepspeed': {'available': ds_cls is not None, 'error': ds_error,
                             'version': _ds_version()},
               'targets': {k: f'{op} {b}' for k, (op, b) in TARGETS.items()},
               'environment': environment(), 'results': results}
    path = write_json('cpu_adam', payload)
    rows = [['threads', 'scenario', 'ours ms', 'torch ms', 'ds ms', 'ours/torch', 'ours/ds',
             'ours/torch cpu', 'ours GB/s', 'copy GB/s', 'triad GB/s', 'add_ GB/s', 'ours/copy',
             'ours/add_', 'B/param ours|peers', 'load 1min']]
    for r in results:
        med, rat, bw = r['median_s_per_step'], r['ratios'], r['achieved_GBps']
        rows.append([r['threads'], r['scenario'], f"{med['ours'] * 1e3:.1f}",
                     f"{med['torch'] * 1e3:.1f}",
                     f"{med['deepspeed'] * 1e3:.1f}" if 'deepspeed' in med else 'n/a',
                     f"{rat['ours_over_torch']:.3f}",
                     f"{rat['ours_over_deepspeed']:.3f}" if 'ours_over_deepspeed' in rat else 'n/a',
                     f"{rat['ours_over_torch_cpu_time']:.3f}",
                     f"{bw['ours']:.1f}", f"{bw['stream_copy']:.1f}", f"{bw['stream_triad']:.1f}",
                     f"{bw['stream_add_inplace']:.1f}", f"{rat['ours_bandwidth_over_copy']:.2f}",
                     f"{rat['ours_bandwidth_over_add_inplace']:.2f}",
                     f"{r['bytes_per_param']['ours']}|{r['bytes_per_param']['torch']}",
                     f"{r['load_average_before'][0]:.2f}->{r['load_average_after'][0]:.2f}"])
    print(f'simd path: {payload["simd_path"]}; {args.params} parameters; '
          f'deepspeed: {"ok" if ds_cls else ds_error}')
    print_table(rows)
    print(f'wrote {path}')


def _ds_version():
    try:
        import deepspeed
        return deepspeed.__version__
    except BaseException:
        return None


if __name__ == '__main__':
    main()
