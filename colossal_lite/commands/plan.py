"""``colossal-lite plan --model NAME --devices N --memory-gb G [--cluster FILE] [--batch B]
[--seq S] [--write FILE]``: choose the parallel layout automatically (docs/planner.md).

Prints the chosen config, its predicted step time and memory per device and the
runners-up with why they lost; ``--write FILE`` saves the config as a ``.py`` file that
``colossal-lite train FILE --nproc N`` runs. ``--cluster``: a profile JSON (``python -m
colossal_lite.auto.profile`` measures one) or a shipped name (nvlink8, nodes4x8, pcie8).
Exit status 2 on bad arguments or when nothing fits. ``--graph`` plans a Hugging Face model op
by op instead (``plan_graph.py``).

After the layer-level plan it also runs the graph-level planner on the same model and devices
and prints which wins under one cost model (``auto/compare.py``; ``--level`` picks the graph
search's level, ``--no-graph`` skips it).
"""
from __future__ import annotations

import sys

from ..auto import plan
from ..auto.compare import compare_plans
from ..auto.model_spec import model_shape, resolve_model_name
from .plan_graph import run_graph


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        'plan', help='choose the parallel layout for a model and a cluster',
        epilog='example: colossal-lite plan --model gpt2-small --devices 8 --memory-gb 16')
    parser.add_argument('--model', default=None,
                        help="a model_zoo preset (gpt2-small, bert-base, vit-base, ...) or "
                             "'kind:preset' (gpt:tiny); required without --graph")
    parser.add_argument('--devices', type=int, required=True, help='number of devices N')
    parser.add_argument('--memory-gb', type=float, default=None,
                        help="memory budget per device in GiB (default: the cluster profile's)")
    parser.add_argument('--cluster', default=None,
                        help='cluster profile JSON or shipped name (default nvlink8)')
    parser.add_argument('--batch', type=int, default=8, help='global batch (default 8)')
    parser.add_argument('--seq', type=int, default=None,
                        help="sequence length (default: the model's max_positions)")
    parser.add_argument('--write', default=None, help='save the chosen config as this .py file')
    parser.add_argument('--no-graph', action='store_true',
                        help='skip the graph-level comparison that follows the plan (it traces '
                             'the model and searches op by op: a few seconds)')
    graph = parser.add_argument_group('graph-level planning of any Hugging Face causal LM '
                                      '(docs/auto_graph.md)')
    graph.add_argument('--graph', action='store_true', help='plan op by op (auto/graph)')
    graph.add_argument('--hf', default=None, help='a local Hugging Face model directory')
    graph.add_argument('--hf-config', default=None,
                       help='a config JSON file or inline JSON with model_type')
    graph.add_argument('--mesh', default=None, help='mesh axes, e.g. data=2,tensor=4 '
                                                    '(default: tensor=N)')
    graph.add_argument('--level', default='fast', choices=('fast', 'optimal'),
                       help='the graph search (also the one --model compares with)')
    graph.add_argument('--show', type=int, default=40, help='nodes listed by explain()')
    graph.add_argument('--write-plan', default=None, help='save the plan JSON here')
    parser.set_defaults(run=run)


def run(args) -> int:
    if args.graph:
        return run_graph(args)
    if not args.model:
        print('colossal-lite plan: --model is required (or --graph with --hf/--hf-config)',
              file=sys.stderr)
        return 2
    try:
        result = plan(args.model, devices=args.devices, memory_gb=args.memory_gb,
                      cluster=args.cluster, batch=args.batch, seq=args.seq)
    except (ValueError, NotImplementedError) as exc:
        print(f'colossal-lite plan: {exc}', file=sys.stderr)
        return 2
    print(result.report())
    if not args.no_graph:
        print(graph_comparison(result, args))
    if args.write:
        if not args.write.endswith('.py'):
            print(f'colossal-lite plan: --write needs a .py file name, got {args.write!r}',
                  file=sys.stderr)
            return 2
        with open(args.write, 'w') as f:
            f.write(result.to_py())
        print(f'wrote {args.write}')
    return 0


def graph_comparison(result, args) -> str:
    """The graph-level plan beside ``result`` (``auto.compare.compare_plans``'s report); a
    failure is reported in the text: the layer plan above stands."""
    try:
        kind, preset = resolve_model_name(args.model)
        shape = model_shape(kind, preset, args.seq)
        return compare_plans(result, shape, args.batch, args.level).report()
    except Exception as exc:  # noqa: BLE001 - an optional section never hides the plan
        return (f'graph-level comparison failed: {type(exc).__name__}: {exc} '
                f'(--no-graph skips it)')
