"""The ``colossal-lite`` command: ``colossal-lite train CONFIG [--nproc N] [--steps S]``.

``train`` checks the config (and that N processes fit its parallel layout) in
the calling process, then starts N local workers through torch's elastic
launcher -- the code path of ``torchrun --standalone --nproc-per-node N`` -- with
gloo on CPU and ``OMP_NUM_THREADS=1`` per worker. Each worker calls
``launch_from_torch(config)`` and trains the job of the config's ``model``,
``data``, ``train``, ``optimizer`` and ``lr_scheduler`` sections (see
``colossal_lite/job.py``) through ``initialize`` and ``Trainer``. Rank 0 prints the
loss every ``train.log_every`` steps, then tokens/s (or samples/s), peak memory
per rank, bytes communicated per ParallelMode and a summary line.

When a worker raises, the launcher stops all the others and the command exits
with status 1 and a message naming the rank and its exception; Ctrl-C stops
every worker and exits with status 130. Without installing the package:
``python -m colossal_lite.cli train CONFIG``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from typing import List, Optional

from .config import ConfigError, load_config, parse_parallel


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='colossal-lite', description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='command', required=True)
    train = sub.add_parser('train', help='train the model a config file describes')
    train.add_argument('config', help='a .py config file (see configs/)')
    train.add_argument('--nproc', type=int, default=1, help='local processes to start (default 1)')
    train.add_argument('--steps', type=int, default=None, help="override the config's train.steps")
    train.add_argument('--port', type=int, default=0, help='rendezvous port (default: a free one)')
    return parser


def check_job(config_path: str, nproc: int, steps: Optional[int]):
    """Every check that can fail before a process starts: config keys, layout vs nproc, job."""
    from .job import parse_job
    if nproc < 1:
        raise ConfigError(f'--nproc must be a positive integer, got {nproc}')
    if steps is not None and steps < 1:
        raise ConfigError(f'--steps must be a positive integer, got {steps}')
    from .initialize import _handler_options
    cfg = load_config(config_path)
    layout = parse_parallel(cfg.get('parallel')).with_world_size(nproc)
    spec = parse_job(cfg)
    _handler_options(cfg)
    if cfg.get('zero') is not None or layout.pipeline > 1:
        raise ConfigError("'zero' and 'parallel.pipeline' > 1 are not implemented yet "
                          "(later issues); remove them to train")
    batch = spec.train['global_batch_size']
    if batch % layout.data:
        raise ConfigError(f"'train.global_batch_size' = {batch} must be divisible by the "
                          f"data-parallel size {layout.data} (= {nproc} processes / "
                          f"(pipeline*tensor = {layout.pipeline * layout.tensor}))")
    _check_layout_fits_job(layout, spec, batch // layout.data)
    return cfg, layout, spec


# how many ways each tensor mode splits a replica's batch
_BATCH_SPLIT = {'2d': lambda l: l.tensor_grid, '2.5d': lambda l: l.depth * l.tensor_grid,
                '3d': lambda l: l.tensor_grid ** 2}


def _check_layout_fits_job(layout, spec, replica_batch: int):
    split = _BATCH_SPLIT.get(layout.mode, lambda l: 1)(layout)
    if replica_batch % split:
        raise ConfigError(f"tensor mode {layout.mode!r} splits each replica's batch of "
                          f"{replica_batch} (global batch / data size) {split} ways: make "
                          f"'train.global_batch_size' a multiple of {split * layout.data}")
    seq_len = spec.data.get('seq_len')
    if layout.mode == 'sequence' and seq_len is not None and seq_len % layout.tensor:
        raise ConfigError(f"sequence parallelism over {layout.tensor} ranks needs "
                          f"'data.seq_len' divisible by {layout.tensor}, got {seq_len}")


def _error_files(err) -> List[tuple]:
    """(mtime, local rank, message, traceback) of every error file the failed run left, oldest first.

    The launcher reports only the first failure it polls, which may be a rank that died
    because another rank's crash closed its connections; every worker records its own
    exception in ``<attempt dir>/<local rank>/error.json``, so read them all."""
    found, dirs = [], set()
    for failure in err.failures.values():
        if failure.error_file and os.path.isfile(failure.error_file):
            dirs.add(os.path.dirname(os.path.dirname(failure.error_file)))
    for attempt in dirs:
        for name in os.listdir(attempt):
            path = os.path.join(attempt, name, 'error.json')
            if not (name.isdigit() and os.path.isfile(path)):
                continue
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            info = data.get('message', data)
            message = info.get('message', '') if isinstance(info, dict) else str(info)
            stack = info.get('extraInfo', {}).get('py_callstack', '') if isinstance(info, dict) else ''
            found.append((os.path.getmtime(path), int(name), message.strip(), stack))
    return sorted(found)


def _failure_message(err) -> str:
    """'rank R failed first: <exception>' with its traceback, then the ranks that failed after."""
    found = _error_files(err)
    if not found:
        found = [(0, f.local_rank, f'exit code {f.exitcode}', '') for f in err.failures.values()]
    _, rank, message, stack = found[0]
    lines = [f'rank {rank} failed first: {message.splitlines()[0] if message else "?"}']
    for _, other, text, _ in found[1:]:
        lines.append(f'  then rank {other}: {text.splitlines()[0] if text else "?"}')
    if stack:
        lines.append(f'traceback of rank {rank}:\n{stack.rstrip()}')
    return '\n'.join(lines)


def start_method() -> str:
    """'fork' on CPU (the workers inherit the imported torch: seconds instead of tens of
    seconds to start 4 processes on 2 cores); 'spawn' when CUDA is present (no fork after
    a CUDA context)."""
    import torch
    return 'spawn' if torch.cuda.is_available() else 'fork'


def train_command(args, entrypoint=None) -> int:
    """Check the job, run ``entrypoint(config_path, steps)`` (default: the trainer of
    ``colossal_lite.worker``) on ``args.nproc`` processes; the exit status."""
    try:
        _, layout, spec = check_job(args.config, args.nproc, args.steps)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f'colossal-lite: bad config {args.config}: {exc}', file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ['OMP_NUM_THREADS'] = '1'
    logging.getLogger('torch.distributed.elastic').setLevel(logging.CRITICAL)  # we report failures
    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=str(uuid.uuid4()),
        rdzv_backend='c10d', rdzv_endpoint=f'127.0.0.1:{args.port}', max_restarts=0,
        monitor_interval=0.2, start_method=start_method())
    print(f'colossal-lite: {spec.kind} on {args.nproc} process(es), layout data={layout.data} '
          f'pipeline={layout.pipeline} tensor={layout.tensor} ({layout.mode or "none"})', flush=True)
    if entrypoint is None:
        from .worker import worker_main as entrypoint
    try:
        elastic_launch(launch_config, entrypoint)(os.path.abspath(args.config), args.steps)
    except ChildFailedError as err:
        print(f'colossal-lite: training stopped, every process was ended:\n'
              f'{_failure_message(err)}', file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException) as exc:
        print(f'colossal-lite: interrupted ({exc}); every process was ended', file=sys.stderr)
        return 130
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == 'train':
        return train_command(args)
    return 2


if __name__ == '__main__':
    sys.exit(main())
