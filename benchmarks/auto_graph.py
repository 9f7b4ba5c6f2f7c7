"""The graph-level auto plan against our hand layout on the same model, and the search time.

Step time: one GPT-2- or BERT-shaped ``transformers`` model (``--model``; seed 0, same on every
rank; BERT trains a masked LM on random targets with every third position ignored), on
``tp`` forked CPU ranks (gloo, one thread each), one launch per hand layout (``--layouts``):

* ``auto``: the unmodified HF model through ``colossal_lite.auto.parallelize`` on a mesh of
  ``tp`` devices, level ``fast``, planned for this machine's measured profile (``--cluster``;
  ``--budget`` adds a memory cap of half the replicated plan's predicted peak): the planner
  chooses between batch splits (data parallel), tensor splits and their mixes per op;
* ``hand``: ``model_zoo.hf.gpt_from_hf`` (``BERT.from_hf``) under the launched hand layout: ``1d`` (Megatron,
  tensor = tp), ``dp`` (data = tp, bucketed all_reduce), ``2d`` (SUMMA), ``dp2x1d``
  (data 2 x 1D tp/2); each replica runs its rows of the same global batch;
* ``pinned`` (``1d`` launch, GPT-2): the same HF model through ``parallelize`` with the hand layout
  pinned (``tests/auto_graph_models.gpt2_megatron_pins``): the executor's own cost, apart
  from the plan it chooses.

Every side trains through ``initialize`` -> Engine (AdamW): what a user's loop runs. Without
data parallelism both are checked to give the same loss on the same batch; then the steps
are timed, alternated round by round within the launch; rank 0's median per-round ratio
auto / hand on wall and CPU time is reported. Auto runs the same plan in every launch, so
auto / the best hand layout is the largest of the per-launch ratios (target <= 1.05).

Search time: Llama-3-8B shapes (32 layers, batch 64 x 2048) on a 64-device 8 x 8 mesh
under ``nvlink8``, 80 GiB per device (at 70 the search finds no plan: its least predicted
peak is 73 GiB), both levels, end to end from the meta-device model
(targets: optimal <= 30 s, fast <= 3 s with an objective within 5% of optimal).

    python benchmarks/auto_graph.py [--tp 4 --layouts 1d dp --hidden 256 --layers 4
        --seq 128 --batch 8] [--search-layers 32] [--skip-search | --search-only]
Writes benchmarks/results/auto_graph.json (auto_graph_step.json with --skip-search).
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

from benchmarks._common import (environment, print_table, timed_ratios,  # noqa: E402
                                write_json)
from benchmarks.gpt_tp_vs_torch import batch, hf_model  # noqa: E402
from colossal_lite.models import HFCausalLM  # noqa: E402
from tests.auto_graph_models import gpt2_megatron_pins  # noqa: E402


MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'profiles',
                        'stops20_21.json')


def hf_bert(args):
    """A ``transformers`` BERT masked LM (post-LN, tied decoder, exact GELU), seed 0."""
    import transformers
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=args['vocab'], hidden_size=args['hidden'], num_hidden_layers=args['layers'],
        num_attention_heads=args['heads'], intermediate_size=4 * args['hidden'],
        max_position_embeddings=args['seq'], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).train()


def mlm_labels(ids: torch.Tensor) -> torch.Tensor:
    """Masked-LM targets: random tokens (seed 2), every third position ignored (-100)."""
    labels = torch.randint(0, int(ids.max()) + 1, ids.shape,
                           generator=torch.Generator().manual_seed(2))
    labels[:, ::3] = -100
    return labels


def sides(args, ids, data_rank: int, data: int):
    """``(auto model, its example inputs, its loss_fn, hand model, hand criterion, the hand
    side's local inputs and labels)`` for ``args['model']``: GPT-2 trains on its own ids
    (shifted inside), BERT on masked-LM labels; the hand side reads its replica's rows."""
    from model_zoo import BERT, BertPretrainingLoss, GPTLMLoss
    from model_zoo.hf import gpt_from_hf
    from tests.auto_graph_models import WithLabels, output_loss
    if args['model'] == 'gpt2':
        local = ids.chunk(data)[data_rank]
        return (HFCausalLM(hf_model(args).train()), (ids,), None,
                gpt_from_hf(hf_model(args)).train(), GPTLMLoss(), local, local)
    labels = mlm_labels(ids)
    mlm = BertPretrainingLoss()
    return (WithLabels(hf_bert(args)), (ids, labels), output_loss,
            BERT.from_hf(hf_bert(args)).train(), lambda out, y: mlm(out, y),
            ids.chunk(data)[data_rank], labels.chunk(data)[data_rank])


def _budget_gb(model, inputs, loss_fn, tp, cluster) -> float:
    from colossal_lite.auto.cluster import load_profile
    from colossal_lite.auto.graph.api import search
    from colossal_lite.auto.graph.space import Space
    from colossal_lite.auto.graph.trace import capture
    space = Space(capture(model, inputs, loss_fn), (tp,))
    free = search(space, load_profile(cluster), None, 'fast', {'tensor': tp}, device='cpu')
    return free.predicted['memory_bytes'] / 2 ** 30 / 2


# hand layouts on ``tp`` ranks: (launched parallel section, data-parallel degree)
HAND_LAYOUTS = {'1d': lambda n: (dict(tensor=dict(size=n, mode='1d')), 1),
                'dp': lambda n: ({}, n),
                '2d': lambda n: (dict(tensor=dict(size=n, mode='2d')), 1),
                'dp2x1d': lambda n: (dict(tensor=dict(size=n // 2, mode='1d')), 2)}


def engine_steps(model, criterion, batch):
    """One ``initialize`` -> Engine training step (AdamW, lr 1e-4) as a callable: what a
    user's loop runs, gradient handler, ``foreach`` choice and all."""
    import colossal_lite as clt
    from colossal_lite.testing import engine_step
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), criterion)
    return lambda: engine_step(engine, batch)


def bench_rank(rank, args):
    warnings.filterwarnings('ignore')
    from colossal_lite.auto import parallelize
    from colossal_lite.context import ParallelMode, global_context as gpc
    ids = batch(args)
    data = gpc.get_world_size(ParallelMode.DATA)
    model, inputs, loss_fn, hand, loss, local, labels = sides(
        args, ids, gpc.get_local_rank(ParallelMode.DATA), data)
    start = time.perf_counter()
    budget = _budget_gb(sides(args, ids, 0, 1)[0], inputs, loss_fn, args['tp'],
                        args['cluster']) if args['budget'] else None
    auto, plan = parallelize(model, inputs, loss_fn=loss_fn, mesh={'tensor': args['tp']},
                             memory_gb=budget, cluster=args['cluster'])
    setup_s = time.perf_counter() - start
    with torch.no_grad():
        auto_loss, hand_loss = auto(*inputs).item(), loss(hand(local), labels).item()
    if data == 1 and abs(auto_loss - hand_loss) > 1e-4 * max(1.0, abs(hand_loss)):
        raise RuntimeError(f'losses differ: auto {auto_loss}, hand {hand_loss}')
    runs = {'auto': engine_steps(auto, lambda out, _: out, (inputs, inputs[-1])),
            'hand': engine_steps(hand, loss, (local, labels))}
    out = {'check': {'auto_loss': auto_loss, 'hand_loss': hand_loss},
           'auto_setup_s': setup_s, 'plan_params': plan.params,
           'predicted_step_s': plan.predicted['step_s'],
           'timed': timed_ratios(runs, 'auto', 'hand', args['repeats'], args['steps'])}
    if args['layout'] == '1d' and args['model'] == 'gpt2':
        pinned, pinned_plan = parallelize(HFCausalLM(hf_model(args).train()), (ids,),
                                          mesh={'tensor': args['tp']}, cluster=args['cluster'],
                                          pins=gpt2_megatron_pins(args['layers']))
        runs['pinned'] = engine_steps(pinned, lambda out, _: out, (ids, ids))
        out['pinned_predicted_step_s'] = pinned_plan.predicted['step_s']
        out['timed_pinned'] = timed_ratios(runs, 'pinned', 'hand', args['repeats'],
                                           args['steps'])
    return out


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
    p.add_argument('--model', choices=('gpt2', 'bert'), default='gpt2',
                   help='GPT-2 (causal LM) or BERT (masked LM), both from transformers')
    p.add_argument('--tp', type=int, nargs='+', default=[4], help='ranks')
    p.add_argument('--layouts', nargs='+', default=['1d', 'dp'], choices=sorted(HAND_LAYOUTS),
                   help='hand layouts timed against the auto plan, one launch each')
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
    p.add_argument('--out', default='auto_graph_step',
                   help='results name of a --skip-search run (benchmarks/results/NAME.json)')
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
    rows = [['ranks', 'hand layout', 'plan', 'clock', 'auto s/step', 'hand s/step',
             'ratio auto/hand']]
    results = {'step_time': {}}
    for tp in args['tp']:
        per_layout = results['step_time'][str(tp)] = {}
        for layout in args['layouts']:
            parallel, data = HAND_LAYOUTS[layout](tp)
            if args['batch'] % data:
                raise SystemExit(f'--batch {args["batch"]} must divide by the data degree '
                                 f'{data} of layout {layout}')
            res = run_distributed(bench_rank, tp, dict(parallel=parallel),
                                  dict(args, tp=tp, layout=layout), timeout=1800,
                                  collective_timeout=900)[0]
            per_layout[layout] = res
            for name, key in (('auto', 'timed'), ('pinned', 'timed_pinned')):
                for clock in ('wall', 'cpu') if key in res else ():
                    s = res[key][clock]
                    med = s['median_s_per_step']
                    rows.append([str(tp), layout, name, clock, f"{med[name]:.4f}",
                                 f"{med['hand']:.4f}", f"{s['ratio_ours_over_theirs']:.3f}"])
        # auto is the common reference: auto / best hand = the largest auto / hand ratio
        best_hand = results.setdefault('auto_over_best_hand', {})[str(tp)] = {}
        for clock in ('wall', 'cpu'):
            ratios = {lay: r['timed'][clock]['ratio_ours_over_theirs']
                      for lay, r in per_layout.items()}
            best = max(ratios, key=ratios.get)
            best_hand[clock] = {'layout': best, 'ratio': ratios[best]}
            rows.append([str(tp), f'best: {best}', 'auto', clock, '', '',
                         f'{ratios[best]:.3f}'])
    print_table(rows)
    if args['skip_search']:
        print('wrote', write_json(args['out'], {'args': args, 'environment': environment(),
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
