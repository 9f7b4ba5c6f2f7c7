"""The colossal-lite command: colossal-lite train CONFIG [--nproc N] [--steps S] [--resume DIR]
[--max-restarts N] [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT [--rdzv-id ID]].

``train`` checks the config, that N processes fit its parallel layout and that the
model splits over it (a build on the meta device) in the calling process, prepares the
data, then starts N local workers with ``colossal_lite.launcher.run_workers`` (torch's
elastic launcher, the code path of ``torchrun --standalone --nproc-per-node N``; spawned
workers, gloo on CPU, ``OMP_NUM_THREADS=1``). Each worker calls
``launch_from_torch(config)`` and trains the job of the config's ``model``,
``data``, ``train``, ``optimizer`` and ``lr_scheduler`` sections (see
``colossal_lite/job/``) through ``initialize`` and ``Trainer``. Rank 0 prints the
loss every ``train.log_every`` steps, then tokens/s (or samples/s), peak memory
per rank, bytes communicated per ParallelMode and a summary line.

When a worker raises, the launcher stops all the others and the command exits
with status 1, one line per failed rank (a rank killed by a signal first, then the
rank that raised first) and that rank's traceback once; Ctrl-C stops every worker and
exits with status 130. With a ``checkpoint`` section the job saves a checkpoint directory
every ``checkpoint.interval`` steps and at its end; ``--resume DIR`` continues from one
(also under another layout), and ``--max-restarts N`` lets the elastic agent restart a
failed group up to N times, each restart continuing from the last complete checkpoint in
``checkpoint.path`` (``colossal_lite/run_state.py``). At the end rank 0 writes
``metrics.jsonl`` and ``loss.png`` (with matplotlib) into ``train.run_dir``. Without
installing the package: ``python -m colossal_lite.cli train CONFIG``.

On several nodes the command runs once per node with the same ``--nnodes``,
``--rdzv-endpoint`` (node 0's address) and ``--rdzv-id``, and its own ``--node-rank``
(or SLURM's variables: ``launcher/nodes.py``); the agents meet in torch's c10d rendezvous
and node R holds ranks R*N .. R*N+N-1 (``launcher/rendezvous.py``); the world size is
nnodes x N.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ._version import __version__
from .commands import add_parsers
from .checkpoint import UnsafeCheckpointError
from .config import ConfigError, load_config
from .job import check_data, check_layout, check_paths, prepare_data
from .launcher import run_workers
from .launcher.nodes import add_node_arguments, nodes_from_args
from .run_state import saved_step
from .worker import worker_main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='colossal-lite', description='Train a config\'s model on N local processes '
        '(data, pipeline, tensor and sequence parallel, ZeRO) and report loss, throughput, '
        'memory and communication.',
        epilog='example: colossal-lite train configs/gpt_dp2_tp2.py --nproc 4')
    parser.add_argument('--version', action='version', version=f'colossal-lite {__version__}')
    sub = parser.add_subparsers(dest='command', required=True)
    train = sub.add_parser('train', help='train the model a config file describes')
    train.add_argument('config', help='a .py config file (see configs/)')
    train.add_argument('--nproc', type=int, default=1, help='local processes to start (default 1)')
    train.add_argument('--steps', type=int, default=None, help="override the config's train.steps")
    train.add_argument('--port', type=int, default=0, help='rendezvous port (default: a free one)')
    train.add_argument('--resume', metavar='DIR', default=None,
                       help='continue the run saved in checkpoint DIR (any layout)')
    train.add_argument('--max-restarts', type=int, default=0, metavar='N',
                       help='restart a failed group up to N times, each from the last complete '
                            "checkpoint in the config's checkpoint.path (default 0)")
    add_node_arguments(train)
    train.set_defaults(run=train_command)
    add_parsers(sub)
    return parser


def check_job(config_path: str, nproc: int, steps: Optional[int], resume: Optional[str] = None,
              max_restarts: int = 0, nnodes: int = 1):
    """Every check that can fail before a process starts: the config's typed sections
    (``load_config``: each section checked once, ZeRO's unsupported combinations included),
    the layout vs ``nproc``, the job's data (``job.check_data``), the job vs the layout and
    its pipeline (``job.check_layout``: divisibility of every split size and a build of the
    model on the meta device, cut as the run cuts it), the directories the run writes
    (``job.check_paths``), ``--max-restarts`` (a restart resumes from ``checkpoint.path``),
    the ``--resume`` checkpoint (complete, read as data, steps left: :func:`check_resume`),
    then the data prepared once (``job.prepare_data``: for ``hf`` the tokenizer and the
    packed blocks). The world is ``nnodes`` x ``nproc`` processes. Returns
    ``(settings, layout, spec)``."""
    settings, layout, spec = check_config(config_path, nproc, steps, max_restarts, nnodes)
    check_resume(spec, resume)
    prepare_data(spec, settings.pipeline.num_microbatches)
    return settings, layout, spec


def check_config(config_path: str, nproc: int, steps: Optional[int], max_restarts: int = 0,
                 nnodes: int = 1):
    """The checks of :func:`check_job` that concern the config and the flags (no checkpoint
    is read, no data prepared): ``(settings, layout, spec)``."""
    if nproc < 1:
        raise ConfigError(f'--nproc must be a positive integer, got {nproc}')
    if max_restarts < 0:
        raise ConfigError(f'--max-restarts must be >= 0, got {max_restarts}')
    settings = load_config(config_path).settings
    layout = _with_nproc(settings.layout, nproc, nnodes)
    spec = check_data(settings.job.with_steps(steps))
    check_layout(spec, layout, settings.pipeline, settings.auto)
    check_paths(spec)
    return settings, layout, spec


def check_resume(spec, resume: Optional[str]) -> None:
    """The ``--resume`` checkpoint: complete, its ``common.pt`` read as data
    (``run_state.saved_step``: ``checkpoint.UnsafeCheckpointError`` for a file that would run
    code, ``ValueError`` for one that is unreadable), and steps left of the job. Reads no
    other file, starts nothing."""
    if resume is not None:
        step, total = saved_step(resume), spec.train.steps
        if total is not None and step >= total:
            raise ConfigError(f'--resume {resume} was saved at step {step}: nothing is left of '
                              f'the {total} steps of this job (raise --steps or train.steps)')


def _with_nproc(layout, nproc: int, nnodes: int = 1):
    """``layout.with_world_size(nnodes * nproc)``; its error suggests the ``--nproc`` that
    fits."""
    world = nnodes * nproc
    try:
        return layout.with_world_size(world)
    except ConfigError as err:
        need = layout.pipeline * layout.tensor * (layout.data or getattr(layout, 'expert', 1))
        if layout.data is None:   # a multiple of pipeline*tensor (*expert: E divides data)
            need *= max(1, round(world / need))
        if nnodes == 1:
            raise ConfigError(f'{err}: run with --nproc {need}') from None
        hint = (f'run with --nproc {need // nnodes}' if need % nnodes == 0 else
                f'no --nproc fits --nnodes {nnodes}')
        raise ConfigError(f'{err} (--nnodes {nnodes} x --nproc {nproc}): {hint} (a world size '
                          f'of {need})') from None


def train_command(args, entrypoint=None) -> int:
    """Check the job, run ``entrypoint(config_path, steps[, resume])`` (default: the trainer
    of ``colossal_lite.worker``; ``resume`` only with ``--resume``) on ``args.nproc``
    processes, restarted up to ``--max-restarts`` times; the exit status."""
    resume = getattr(args, 'resume', None)
    resume = os.path.abspath(resume) if resume else None
    try:
        nodes = nodes_from_args(args)
        settings, layout, spec = check_config(args.config, args.nproc, args.steps,
                                              getattr(args, 'max_restarts', 0), nodes.nnodes)
    except CONFIG_ERRORS as exc:
        return _config_failed(args.config, exc)
    try:   # the checkpoint's errors are the checkpoint's, not the config's
        check_resume(spec, resume)
    except UnsafeCheckpointError as exc:
        print(f'colossal-lite: refused the checkpoint of --resume {resume} as untrusted, '
              f'nothing was run: {exc}', file=sys.stderr)
        return 2
    except RESUME_ERRORS as exc:
        print(f'colossal-lite: cannot resume from --resume {resume}, nothing was run: {exc}',
              file=sys.stderr)
        return 2
    try:
        prepare_data(spec, settings.pipeline.num_microbatches)
    except CONFIG_ERRORS as exc:
        return _config_failed(args.config, exc)
    on = (f'{args.nproc} process(es)' if nodes.nnodes == 1 else
          f'{nodes.nnodes} node(s) x {args.nproc} process(es)')
    auto = settings.auto
    mesh = (auto.mesh_text() if auto is not None and auto.mesh is not None else
            f'dict(data={layout.data}, tensor={layout.tensor}) (the launched axes)')
    where = (f'auto plan ({auto.level}) on mesh {mesh}' if auto is not None else
             f'layout data={layout.data}'
             + (f' expert={layout.expert}' if getattr(layout, 'expert', 1) > 1 else '')
             + f' pipeline={layout.pipeline} tensor={layout.tensor} '
             f'({layout.mode or "none"})')
    print(f'colossal-lite: {spec.kind} on {on}, {where}', flush=True)
    if nodes.nnodes > 1:
        print(f'colossal-lite: {nodes.describe()}', flush=True)
    entrypoint = entrypoint or worker_main
    entry_args = (os.path.abspath(args.config), args.steps) + ((resume,) if resume else ())
    return run_workers(args.nproc, args.port, entrypoint, *entry_args, what='training',
                       max_restarts=getattr(args, 'max_restarts', 0), nodes=nodes)


CONFIG_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotImplementedError)
# a --resume checkpoint that is incomplete, unreadable or has no steps left (ConfigError)
RESUME_ERRORS = (ValueError, FileNotFoundError)


def _config_failed(config: str, exc: Exception) -> int:
    """Print a parent-side error of the config (or the flags) of ``train``; exit status 2."""
    if isinstance(exc, NotImplementedError):
        print(f'colossal-lite: not supported yet by {config}: {exc}', file=sys.stderr)
    else:
        print(f'colossal-lite: bad config {config}: {exc}', file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == '__main__':
    sys.exit(main())
