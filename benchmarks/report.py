"""Regenerate the benchmark numbers quoted in docs/ from ``benchmarks/results/*.json``.

A doc marks each quoted measurement as a block::

    <!-- report:NAME -->
    (generated text)
    <!-- /report -->

and ``python benchmarks/report.py`` rewrites the text between the markers with
``RENDERERS[NAME]`` applied to ``results/NAME.json``. ``--check`` rewrites nothing and exits
1 when a doc's block differs from what the stored JSON gives (a stale doc). No benchmark
runs: only the stored results are read.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, 'benchmarks', 'results')
BLOCK = re.compile(r'(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report -->)', re.S)


def _load(name: str, results_dir: str) -> dict:
    with open(os.path.join(results_dir, f'{name}.json')) as f:
        return json.load(f)


def _load_now(env: dict) -> str:
    """The 1-minute load average when the results were written."""
    return f"{env['load_average_1_5_15_min'][0]:.1f}"


def _span(values: List[float], fmt: str = '{:.2f}') -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f'{lo}-{hi}'


# ------------------------------------------------------------------ renderers
def render_gpt_tp_vs_torch(d: dict) -> str:
    """Ours / torch's fair tensor parallelism: time ratios (wall, CPU; median and range of
    the alternated rounds) and the peak RSS ratio, per tp."""
    c = d['config']

    def clock(tp, name):
        t = d['results'][tp]['timed'][name]
        return (f"{t['ratio_ours_over_theirs']:.2f} {name} "
                f"(rounds {_span(t['per_round_ratios'])})")
    parts = [f"{clock(tp, 'wall')} / {clock(tp, 'cpu')} / "
             f"{d['memory_ratios'][tp]['peak_rss_bytes']:.2f} peak RSS at tp={tp}"
             for tp in sorted(d['results'], key=int)]
    return (f"Whole GPT-2-shaped training step ({c['layers']} layers, h={c['hidden']}, "
            f"V={c['vocab']}, b={c['batch']}, s={c['seq']}, `benchmarks/gpt_tp_vs_torch.py`) vs "
            "torch's `parallelize_module` given its best setup (vocab-parallel embedding, "
            "colwise LM head, `loss_parallel`; same loss from the same weights checked "
            f"first), time and memory ours / torch: {'; '.join(parts)} (medians of "
            f"{c['repeats']} alternated rounds; 1-min load average {_gpt_load(d)} on "
            f"{d['environment']['cpu_count']} cores).\n")


def _gpt_load(d: dict) -> str:
    """The 1-minute load average at the start (where recorded) and the end of the run."""
    end = _load_now(d['environment'])
    return f"{d['load_average_start'][0]:.1f} -> {end}" if 'load_average_start' in d else end


def render_checkpoint_load_memory(d: dict) -> str:
    """Peak RSS growth of a load over (new optimizer slots + largest tensor), per target."""
    by_target: Dict[str, List[float]] = {}
    for case in d['cases']:
        by_target.setdefault(case['load_into'], []).append(case['ratio'])
    parts = [f'{_span(r)} into {name}' for name, r in by_target.items()]
    return (f"`benchmarks/checkpoint_load_memory.py` ({d['model']['hidden']}-wide, "
            f"{d['model']['layers']}-layer GPT with AdamW, saved under {d['saved_under']}, "
            "loaded in fresh processes): peak RSS delta / (new optimizer slots + largest "
            f"tensor) = {'; '.join(parts)}; max {d['max_ratio']:.2f} "
            "(`benchmarks/results/checkpoint_load_memory.json`).\n")


def _zero_rows(d: dict) -> List[str]:
    worlds = sorted(d['results'], key=int)
    head = '| variant | ' + ' | '.join(f'B/param D={w} | s/step D={w} (spread) | '
                                      f'peak RSS MB D={w}' for w in worlds) + ' |'
    rows = [head, '|---' * (1 + 3 * len(worlds)) + '|']
    names = list(dict.fromkeys(n for w in worlds for n in d['results'][w]['variants']))
    for name in names:
        cells = []
        for w in worlds:
            r = d['results'][w]['variants'].get(name, {'error': 'not run'})
            cells += ([r['error'][:20], '', ''] if 'error' in r else
                      [f"{r['bytes_per_param']:.2f}",
                       f"{r['median_step_s']:.2f} ({r['step_s_spread']:.0%})",
                       f"{r['peak_rss_bytes'] / 2**20:.0f}"])
        rows.append(f'| {name} | ' + ' | '.join(cells) + ' |')
    return rows


def _zero_verdict(world: str, t: dict) -> str:
    ours, peer = t['ours_lowest_memory'], t['lowest_memory_peer']
    vs = '; '.join(f"vs {p}: step {v['step_time_ratio']:.2f}x "
                   f"({_span(v['step_time_ratio_per_repeat'])} per repeat, margin "
                   f"{v['step_time_margin']:.0%} {'>' if v['margin_exceeds_spread'] else '<='} "
                   f"spread {v['run_to_run_spread']:.0%}), peak RSS {v['peak_rss_ratio']:.3f}x"
                   for p, v in t['vs'].items())
    met = 'met' if t['met'] else 'not met'
    if not t['margin_exceeds_spread']:
        met += ' -- the step-time margin is within the run-to-run spread: not measurable here'
    return f"* D={world}: {ours} {vs}. Target vs {peer}: **{met}**.\n"


def render_zero_memory(d: dict) -> str:
    """Per variant and world: bytes/param, median step time and spread, peak RSS; verdicts."""
    loads = [statistics.median(r['load_average']['before'][:1] + r['load_average']['after'][:1])
             for r in d['results'].values()]
    head = (f"`python benchmarks/zero_memory.py` ({d['total_s'] / 60:.0f} min): "
            f"{d['params']:,} parameters, fp32, AdamW, {d['batch_per_rank']} x {d['seq']} tokens "
            f"per rank; {d['warmup_steps']} warm-up + {d['timed_steps']} timed steps per variant, "
            f"each variant in fresh ranks, alternated over {d['repeats']} repeats (order reversed "
            "every other repeat). s/step: median over repeats of the per-repeat median (slowest "
            "rank per step); spread: (max - min) / median over repeats; peak RSS: max over "
            f"ranks, median over repeats. Load average about {_span(loads, '{:.1f}')} on "
            f"{d['environment']['cpu_count']} cores.\n\n")
    verdicts = ''.join(_zero_verdict(w, r['target'])
                       for w, r in sorted(d['results'].items(), key=lambda kv: int(kv[0])))
    return head + '\n'.join(_zero_rows(d)) + '\n\n' + verdicts


RENDERERS: Dict[str, Callable[[dict], str]] = {
    'gpt_tp_vs_torch': render_gpt_tp_vs_torch,
    'checkpoint_load_memory': render_checkpoint_load_memory,
    'zero_memory': render_zero_memory,
}


# ------------------------------------------------------------------ docs
def regenerate(text: str, results_dir: str = RESULTS) -> str:
    """``text`` with every report block's body rendered from the stored results."""
    def body(match):
        name = match.group('name')
        if name not in RENDERERS:
            raise KeyError(f'unknown report block {name!r}; known: {sorted(RENDERERS)}')
        return match.group(1) + RENDERERS[name](_load(name, results_dir)) + match.group(4)
    return BLOCK.sub(body, text)


def stale_docs(root: str = ROOT, results_dir: str = RESULTS, write: bool = False) -> List[str]:
    """Docs under ``root/docs`` whose report blocks differ from the stored results
    (rewritten in place when ``write``)."""
    stale = []
    for path in sorted(glob.glob(os.path.join(root, 'docs', '*.md'))):
        with open(path) as f:
            text = f.read()
        new = regenerate(text, results_dir)
        if new != text:
            stale.append(os.path.relpath(path, root))
            if write:
                with open(path, 'w') as f:
                    f.write(new)
    return stale


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--check', action='store_true', help='exit 1 if a doc is stale')
    args = p.parse_args(argv)
    stale = stale_docs(write=not args.check)
    verb = 'stale' if args.check else 'rewrote'
    for path in stale:
        print(f'{verb}: {path}')
    return 1 if args.check and stale else 0


if __name__ == '__main__':
    sys.exit(main())
