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


def _bold(value: float, at_bar: bool, fmt: str) -> str:
    text = fmt.format(value)
    return f'**{text}**' if at_bar else text


def _family(layout: str) -> str:
    """The tensor family of a ``Candidate.describe`` string ('none', '1d', '2.5d', ...)."""
    return re.search(r't=\d+\(([\w.]+)', layout).group(1)


def _heldout_case_rows(d: dict) -> List[str]:
    bars = {name: t['bar'] for name, t in d['targets'].items()}
    rows = ['| case | layouts | τ all (CPU) | τ reported | regret | without Ulysses: τ / regret '
            '| measured ÷ predicted | worst reported plan, memory by max (floor) |',
            '|---|---|---|---|---|---|---|---|']
    for c in d['cases']:
        worst = max(c['reported_memory_error_max'], key=lambda m: abs(m['error']))
        rest = c['without_ulysses']
        rows.append(
            f"| {c['model']}-{c['size']} {c['budget']} | {c['layouts']} | "
            f"{_bold(c['kendall_tau'], c['kendall_tau'] >= bars['tau'], '{:.2f}')} "
            f"({c['kendall_tau_cpu']:.2f}) | {c['kendall_tau_reported']:.2f} | "
            f"{_bold(100 * c['pick_regret'], c['pick_regret'] <= bars['regret'], '{:.0f} %')} | "
            f"{rest['kendall_tau']:.2f} / {100 * rest['pick_regret']:.0f} % | "
            f"{c['measured_over_predicted']:.2f} | {100 * worst['error']:+.1f} % "
            f"({100 * worst['floor_error']:+.1f} %) |")
    return rows


def _heldout_targets(d: dict) -> List[str]:
    t = d['targets']
    misses = [f"{c['model']}-{c['size']} {c['budget']} {100 * c['pick_regret']:.0f} %"
              for c in d['cases'] if c['pick_regret'] > t['regret']['bar']]
    at_bar = [f"{c['model']}-{c['size']} {c['budget']} {c['kendall_tau']:.2f}"
              for c in d['cases'] if c['kendall_tau'] >= t['tau']['bar']]
    verdict = {True: '**pass**', False: '**fail**'}
    return [
        '| target (held out) | measured | verdict |', '|---|---|---|',
        f"| τ ≥ {t['tau']['bar']} in ≥ {t['tau']['share']:.0%} of cases | "
        f"{t['tau']['cases_at_bar']} of {t['tau']['cases']} ({', '.join(at_bar) or 'none'}) | "
        f"{verdict[t['tau']['passed']]} |",
        f"| pick within {t['regret']['bar']:.0%} of the measured best | "
        f"{t['regret']['cases_within']} of {t['regret']['cases']}"
        + (f"; misses {', '.join(misses)}" if misses else '') +
        f" | {verdict[t['regret']['passed']]} |",
        f"| memory of every reported plan within {t['memory']['bar']:.0%} by the maximum | "
        f"{t['memory']['plans_within']} of {t['memory']['plans']} (plan, budget) entries "
        f"({t['memory']['plans_within_by_floor']} of {t['memory']['plans']} by the floor); "
        f"worst {100 * t['memory']['worst']:+.1f} % | {verdict[t['memory']['passed']]} |"]


def _heldout_noise(d: dict) -> List[str]:
    rows = ['| model, budget | layouts | τ run vs run | median gap between runs | τ per run | '
            'regret per run | run 1\'s best, regret in run 2 |', '|---|---|---|---|---|---|---|']
    for model, cases in sorted(d['noise'].items()):
        for n in cases:
            rows.append(
                f"| {model} {n['budget']} | {n['layouts']} | {n['kendall_tau_run_vs_run']:.2f} | "
                f"{100 * n['median_run_gap']:.0f} % | "
                f"{' / '.join(f'{x:.2f}' for x in n['kendall_tau_per_run'])} | "
                f"{' / '.join(f'{100 * x:.0f} %' for x in n['pick_regret_per_run'])} | "
                f"{100 * n['best_of_run_1_regret_in_run_2']:.0f} % |")
    return rows


def _heldout_families(d: dict) -> str:
    """Measured ÷ predicted step time per model and tensor family: the median of its layouts."""
    ratios: Dict[str, Dict[str, List[float]]] = {}
    for r in d['results']:
        ratios.setdefault(f"{r['model']}-{r['size']}", {}).setdefault(
            _family(r['layout']), []).append(r['measured_step_s'] / r['predicted_step_s'])
    return '; '.join(
        f"{model}: " + ', '.join(f'{fam} {statistics.median(v):.2f}'
                                 for fam, v in sorted(fams.items()))
        for model, fams in sorted(ratios.items()))


def render_planner_accuracy_heldout(d: dict) -> str:
    """The held-out sweep: per case τ, regret and memory by the maximum; the targets' verdicts;
    the noise of the models measured twice; measured ÷ predicted per tensor family."""
    before, after = d['load_average_before'][0], d['load_average_after'][0]
    tuned = 'tuned' if d['cost_model_tuned_on_held_out'] else 'not tuned'
    which = d.get('held_out_set', 1)
    command = '--held-out' + (f' --set {which}' if which != 1 else '')
    head = (f"`python benchmarks/planner_accuracy.py {command}` ({d['measure_s'] / 60:.0f} min "
            f"of measurement; 1-min load average {before:.1f} before, {after:.1f} after, on "
            f"{d['environment']['cpu_count']} cores; cost model {tuned} on these cases; "
            f"{len(d['results'])} layouts, {len(d['failed'])} failed).\n\n")
    noise = ', '.join(sorted(d['noise']))
    return (head + '\n'.join(_heldout_case_rows(d)) + '\n\n' + '\n'.join(_heldout_targets(d))
            + f'\n\nThe machine\'s own noise ({noise} measured twice in full):\n\n'
            + '\n'.join(_heldout_noise(d))
            + '\n\nMeasured ÷ predicted step time per tensor family (median of the layouts): '
            + _heldout_families(d) + '.\n')


def render_tp_sequence_parallel(d: dict) -> str:
    """1D + sequence parallelism over plain 1D: saved activations, step peak, tokens/s (wall
    and CPU time, with the per-round ratios) against the targets."""
    c, r, t = d['config'], d['ratios_sp_over_plain'], d['targets']
    met = abs(1 - r['tokens_per_s']) <= t['tokens_per_s_within']
    return (f"Measured (`benchmarks/tp_sequence_parallel.py`, Llama h={c['hidden']}, "
            f"{c['layers']} layers, s={c['seq']}, b={c['batch']}, t={c['tensor']}, "
            f"{c['rounds']} alternated launches of {c['steps']} steps; 1-min load average "
            f"{d['load_average_before'][0]:.1f} -> {d['load_average_after'][0]:.1f} on "
            f"{d['environment']['cpu_count']} cores): saved activations "
            f"{r['saved_activation']:.3f}x plain 1D (target <= {t['saved_activation']}); the "
            f"whole step's allocator peak (logits and gradients included) {r['step_peak']:.2f}x; "
            f"tokens/s **{r['tokens_per_s']:.2f}x** (median of per-round ratios "
            f"{r['tokens_per_s_median_of_rounds']:.2f}, rounds "
            f"{_span(r['tokens_per_s_rounds'])}; CPU time "
            f"{r['cpu_tokens_per_s_median_of_rounds']:.2f}x, rounds "
            f"{_span(r['cpu_tokens_per_s_rounds'])}), target within "
            f"{t['tokens_per_s_within']:.0%}: {'met' if met else 'not met'}.\n")


RENDERERS: Dict[str, Callable[[dict], str]] = {
    'gpt_tp_vs_torch': render_gpt_tp_vs_torch,
    'checkpoint_load_memory': render_checkpoint_load_memory,
    'zero_memory': render_zero_memory,
    'planner_accuracy_heldout': render_planner_accuracy_heldout,
    'planner_accuracy_heldout2': render_planner_accuracy_heldout,
    'tp_sequence_parallel': render_tp_sequence_parallel,
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
