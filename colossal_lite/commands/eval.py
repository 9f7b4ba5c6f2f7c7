"""``colossal-lite eval CKPT [--nproc N] [--tensor-mode M] [--depth D] [--batches B]``: the
test loss (and accuracy for image classifiers) of a checkpoint's weights.

The parent checks the job, the layout and the test batch (``job.check_layout``: the test
loader's batch is ``train.global_batch_size``, split as the tensor mode needs; the model
built on the meta device) before any worker starts (exit status 2). Each worker builds
the job's model, loads the weights (``checkpoint.load_model``), builds its test loader and
engine as training does (``job.build_data``, ``initialize``) and runs ``Trainer.evaluate``
with the training run's hooks (``LossHook``, and ``AccuracyHook`` for non-text jobs) over
the first ``B`` test batches (default: ``train.eval_batches`` for text jobs, every batch
otherwise -- what the training run evaluated). Rank 0 prints ``evaluation: test_loss=... [test_accuracy=...]``.
"""
from __future__ import annotations

import os

from ..config import ConfigError
from ..context import global_context as gpc
from ..initialize import initialize
from ..job import build_criterion, build_data, build_optimizer, check_layout, resolve_vocab
from ..launcher import run_workers
from ..trainer import Trainer
from ..trainer import hooks as H
from ._from_checkpoint import (PARENT_ERRORS, add_layout_arguments, check_world, fail,
                               inference_config, launch_worker, on_nodes)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        'eval', help="a checkpoint's test loss (and accuracy for ViT)",
        epilog='example: colossal-lite eval runs/ckpt --nproc 2')
    add_layout_arguments(parser)
    parser.add_argument('--batches', type=int, default=None,
                        help="test batches to evaluate (default: the job's train.eval_batches "
                             "for text, all for images)")
    parser.set_defaults(run=run)


def prepare(args) -> None:
    if args.batches is not None and args.batches < 1:
        raise ConfigError(f'--batches must be a positive integer, got {args.batches}')
    flags = getattr(args, 'world_flags', None)    # on several nodes (on_nodes)
    cfg = inference_config(args.checkpoint, args.nproc, args.tensor_mode, args.depth, flags)
    layout = cfg.settings.layout.with_world_size(args.nproc)
    check_world(lambda: check_layout(resolve_vocab(cfg.settings.job), layout), args.nproc, flags)


def run(args, entrypoint=None) -> int:
    try:
        nodes, local, args = on_nodes(args)   # args.nproc: all nodes' processes from here on
        prepare(args)
    except PARENT_ERRORS as err:
        return fail('eval', args.checkpoint, err)
    return run_workers(local, args.port, entrypoint or eval_worker,
                     os.path.abspath(args.checkpoint), args.nproc, args.tensor_mode,
                     args.depth, args.batches, what='evaluation', nodes=nodes)


def evaluate_loaded(cfg, model, batches=None) -> dict:
    """The test metrics of ``model`` (weights loaded) for the launched job ``cfg``: the
    training run's evaluation (module doc). Collective."""
    import itertools

    spec = cfg.settings.job
    if batches is None and spec.is_text:
        batches = spec.train.eval_batches
    _, test_dl, _ = build_data(spec, gpc.device)
    engine, _, test_dl, _ = initialize(model, build_optimizer(spec, model), build_criterion(spec),
                                       test_dataloader=test_dl)
    hooks = [H.LossHook()] + ([] if spec.is_text else [H.AccuracyHook()])
    metrics = Trainer(engine).evaluate(itertools.islice(test_dl, batches), hooks=hooks)
    return H.test_metrics(metrics)


def eval_worker(ckpt, nproc, mode, depth, batches):
    """One rank: load, evaluate; rank 0 prints the metrics."""
    cfg, model = launch_worker(ckpt, nproc, mode, depth)
    try:
        metrics = evaluate_loaded(cfg, model, batches)
        if gpc.get_global_rank() == 0:
            print('evaluation: ' + ' '.join(f'{k}={v:.6f}' for k, v in sorted(metrics.items())),
                  flush=True)
        return metrics
    finally:
        gpc.destroy()
