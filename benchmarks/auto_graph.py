"""The graph-level auto plan against our hand layout on the same model, and the search time.

Step time: one GPT-2-shaped ``transformers`` model (seed 0, same on every rank), on ``tp``
forked CPU ranks (gloo, one thread each):

* ``auto``: the unmodified HF model through ``colossal_lite.auto.parallelize`` on a tensor-only
  mesh of ``tp``, level ``fast``, planned for this machine's measured profile (``--cluster``;
  ``--budget`` adds a memory cap of half the replicated plan's predicted peak);
* ``hand``: ``model_zoo.hf.gpt_from_hf`` under ``tensor=dict(mode='1d', size=tp)`` (our
  Megatron layout, the best hand layout for a tensor-only mesh).

* ``pinned``: the same HF model through ``parallelize`` with the hand layout pinned
  (``tests/auto_graph_models.gpt2_megatron_pins``): the executor's own cost, apart from the plan it chooses.

Both are checked to give the same loss on the same batch, then forward + loss + backward +
AdamW are timed, alternated round by round; rank 0's median per-round ratio auto / hand
(and pinned / hand) on wall and CPU time is reported (target <= 1.05).

Search time: Llama-3-8B shapes (32 layers, batch 64 x 2048) on a 64-device 8 x 8 mesh
under ``nvlink8``, 80 GiB per device (at 70 the search finds no plan: its least predicted
peak is 73 GiB), both levels, end to end from the meta-device model
(targets: optimal <= 30 s, fast <= 3 s with an objective within 5% of optimal).

    python benchmarks/auto_graph.py [--tp 4 --hidden 256 --layers 4 --seq 128 --batch 8]
        [--search-layers 32]
Writes benchmarks/results/auto_graph.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import (adamw_step as step_fn, environment, print_table,  # noqa: E402
                                timed_ratios, write_json)
from benchmarks.gpt_tp_vs_torch import batch, hf_model  # noqa: E402
from colossal_lite.models import HFCausalLM  # noqa: E402
from tests.auto_graph_models import gpt2_megatron_pins  # noqa: E402


MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'profiles',
                        'stops20_21.json')


def _budget_gb(model, ids, tp, cluster) -> float:
    from colossal_lite.auto.cluster import load_profile
    from colossal_lite.auto.graph.api import search
    from colossal_lite.auto.graph.space import Space
    from colossal_lite.auto.graph.trace import capture
    space = Space(capture(model, (ids,)), (tp,))
    free = search(space, load_profile(cluster), None, 'fast', {'tensor': tp}, device='cpu')
    return free.predicted['memory_bytes'] / 2 ** 30 / 2


def bench_rank(rank, args):
    warnings.filterwarnings('ignore')
    from colossal_lite.auto import parallelize
    from model_zoo import GPTLMLoss
    from model_zoo.hf import gpt_from_hf
    ids = batch(args)
    hand = gpt_from_hf(hf_model(args)).train()
    loss = GPTLMLoss()
    model = HFCausalLM(hf_model(args).train())
    start = time.perf_counter()
    budget = _budget_gb(HFCausalLM(hf_model(args)), ids, args['tp'], args['cluster']) \
        if args['budget'] else None
    auto, plan = parallelize(model, (ids,), mesh={'tensor': args['tp']}, memory_gb=budget,
                             cluster=args['cluster'])
    setup_s = time.perf_counter() - start
    with torch.no_grad():
        auto_loss, hand_loss = auto(ids).item(), loss(hand(ids), ids).item()
    if abs(auto_loss - hand_loss) > 1e-4 * max(1.0, abs(hand_loss)):
        raise RuntimeError(f'losses differ: auto {auto_loss}, hand {hand_loss}')
    pinned, pinned_plan = parallelize(HFCausalLM(hf_model(args).train()), (ids,),
                                      mesh={'tensor': args['tp']}, cluster=args['cluster'],
                                      pins=gpt2_megatron_pins(args['layers']))
    runs = {'auto': step_fn(auto, lambda m, x: m(x), ids),
            'hand': step_fn(hand, lambda m, x: loss(m(x), x), ids),
            'pinned': step_fn(pinned, lambda m, x: m(x), ids)}
    timed = timed_ratios(runs, 'auto', 'hand', args['repeats'], args['steps'])
    return {'check': {'auto_loss': auto_loss, 'hand_loss': hand_loss},
            'auto_setup_s': setup_s, 'plan_params': plan.params,
            'predicted_step_s': plan.predicted['step_s'],
            'pinned_predicted_step_s': pinned_plan.predicted['step_s'], 'timed': timed,
            'timed_pinned': timed_ratios(runs, 'pinned', 'hand', args['repeats'],
                                         args['steps'])}


def search_time(layers: int) -> dict:
    """End to end from building the meta model, both levels with the stamped capture
    (auto/graph/stamp.py), and ``fast`` again with the full trace (``stamp_repeats=False``),
    after one warm-up export."""
    import transformers
    from colossal_lite.auto.cluster import load_profile
    from colossal_lite.auto.graph.api import search
    from colossal_lite.auto.graph.space import Space
    from colossal_lite.auto.graph import strategies
    from colossal_lite.auto.graph.trace import capture
    warnings.filterwarnings('ignore')
    # the first torch.export of a process pays its imports and caches (~1.3 s here): paid
    # once on a 1-layer model and reported apart, so the three runs below compare alike
    start = time.perf_counter()
    with torch.device('meta'):
        tiny = HFCausalLM(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2)))
    capture(tiny, (torch.zeros(2, 16, dtype=torch.long, device='meta'),))
    out = {'first_export_warmup_s': time.perf_counter() - start}
    for level, stamp in (('fast', True), ('optimal', True), ('fast_full_trace', False)):
        strategies._CACHE.clear()          # each level pays its own enumeration, as a
        strategies._NODE_CACHE.clear()     # fresh process would
        start = time.perf_counter()
        cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096,
                                       intermediate_size=14336, num_hidden_layers=layers,
                                       num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=8192)
        with torch.device('meta'):
            model = HFCausalLM(transformers.LlamaForCausalLM(cfg))
            ids = torch.zeros(64, 2048, dtype=torch.long)
        captured = capture(model, (ids,), stamp_repeats=stamp)
        captured_s = time.perf_counter() - start
        space = Space(captured, (8, 8))
        plan = search(space, load_profile('nvlink8'), 80, level.split('_')[0],
                      {'data': 8, 'tensor': 8}, time_limit=120)
        out[level] = {'end_to_end_s': time.perf_counter() - start, 'capture_s': captured_s,
                      'stamped': captured.stamped,
                      'solve_s': plan.search_seconds, 'decisions': len(space),
                      'objective_s': plan.predicted['step_s'],
                      'memory_gib': plan.predicted['memory_bytes'] / 2 ** 30}
    out['fast_over_optimal_objective'] = out['fast']['objective_s'] / out['optimal']['objective_s']
    out['capture_stamped_over_full'] = out['fast']['capture_s'] / out['fast_full_trace']['capture_s']
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--tp', type=int, nargs='+', default=[4])
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--layers', type=int, default=4)
    p.add_argument('--heads', type=int, default=8)
    p.add_argument('--seq', type=int, default=128)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--vocab', type=int, default=4096)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--steps', type=int, default=1)
    p.add_argument('--search-layers', type=int, default=32)
    p.add_argument('--cluster', default=MEASURED,
                   help='profile the step-time plan is made for (default: this machine, '
                        'measured: benchmarks/results/profiles/stops20_21.json)')
    p.add_argument('--budget', action='store_true',
                   help="also cap memory at half the replicated plan's predicted peak")
    p.add_argument('--skip-search', action='store_true')
    p.add_argument('--search-only', action='store_true',
                   help='only the Llama-3-8B search timing, written to auto_graph_search.json')
    args = vars(p.parse_args())
    from colossal_lite.testing import run_distributed
    if args['search_only']:
        search = search_time(args['search_layers'])
        print(json.dumps(search, indent=1))
        print('wrote', write_json('auto_graph_search', {'args': args, 'environment': environment(),
                                                        'search': search}))
        return
    rows = [['tp plan', 'clock', 'auto s/step', 'hand 1D s/step', 'ratio auto/hand']]
    results = {'step_time': {}}
    for tp in args['tp']:
        config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
        res = run_distributed(bench_rank, tp, config, dict(args, tp=tp), timeout=1800,
                              collective_timeout=900)[0]
        results['step_time'][tp] = res
        for name, key in (('auto', 'timed'), ('pinned', 'timed_pinned')):
            for clock in ('wall', 'cpu'):
                s = res[key][clock]
                med = s['median_s_per_step']
                rows.append([f'{tp} {name}', clock, f"{med[name]:.4f}", f"{med['hand']:.4f}",
                             f"{s['ratio_ours_over_theirs']:.3f}"])
    print_table(rows)
    if args['skip_search']:
        print('wrote', write_json('auto_graph_step', {'args': args, 'environment': environment(),
                                                      **results}))
        return
    results['search'] = search_time(args['search_layers'])
    print_table([['level', 'end to end s', 'solve s', 'decisions', 'objective ms']] + [
        [lvl, f"{r['end_to_end_s']:.1f}", f"{r['solve_s']:.2f}", str(r['decisions']),
         f"{r['objective_s'] * 1e3:.2f}"] for lvl, r in results['search'].items()
        if isinstance(r, dict)])
    print(f"fast / optimal objective: {results['search']['fast_over_optimal_objective']:.4f}")
    print('wrote', write_json('auto_graph', {'args': args, 'environment': environment(),
                                             **results}))


if __name__ == '__main__':
    main()
