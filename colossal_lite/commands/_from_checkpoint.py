"""What ``generate``, ``eval`` and ``export`` share: the job of a checkpoint rebuilt under a
tensor layout of ``--nproc`` processes, the checks that run in the parent before any worker
starts, the job's tokenizer, and the model built and loaded on each worker.

The job's config comes from the checkpoint (``checkpoint.job.job_settings``: ``colossal-lite
train`` saves it as ``extra``). Its parallel layout is replaced by tensor parallelism over
``--nproc`` processes (``--tensor-mode``, default ``1d`` when nproc > 1; on several nodes
``--nnodes`` x ``--nproc``, :func:`on_nodes`) with no pipeline and no data parallelism,
and the training-only sections ``zero``, ``num_microbatches`` / ``gradient_accumulation``
are dropped; ``fp16`` stays (``eval`` evaluates as training did).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..checkpoint import load_model
from ..checkpoint.job import job_settings
from ..config import ConfigError, load_config, parse_parallel
from ..context import global_context as gpc
from ..data import ByteTokenizer
from ..data.hf import get_tokenizer, load_texts
from ..job import build_model, describe_model, resolve_vocab
from ..launcher.nodes import add_node_arguments, nodes_from_args
from ..worker import launch_worker as launch

TRAINING_ONLY = ('parallel', 'zero', 'num_microbatches', 'gradient_accumulation')
MODES = ('1d', '2d', '2.5d', '3d')


def add_layout_arguments(parser: argparse.ArgumentParser, tensor_mode: bool = True) -> None:
    parser.add_argument('checkpoint', help='a checkpoint directory written by colossal-lite train')
    parser.add_argument('--nproc', type=int, default=1,
                        help='processes on this node; the tensor-parallel size is nnodes x nproc '
                             '(default 1: serial)')
    if tensor_mode:
        parser.add_argument('--tensor-mode', choices=MODES, default=None,
                            help='tensor-parallel mode over the processes (default 1d)')
        parser.add_argument('--depth', type=int, default=None, help='2.5D depth d (nproc = d*q*q)')
    parser.add_argument('--port', type=int, default=0, help='rendezvous port (default: a free one)')
    add_node_arguments(parser)


def on_nodes(args):
    """``(nodes, processes on this node, args)`` of a command line with the node flags
    (``launcher.nodes``: flags > SLURM > one node); the returned ``args`` is a copy whose
    ``nproc`` is the world size, nnodes x ``--nproc``: the tensor-parallel size that the
    checks and the workers use, and whose ``world_flags`` names where that size comes from
    (:func:`world_flags`), for the checks' errors."""
    nodes, local = nodes_from_args(args), args.nproc
    if isinstance(local, bool) or not isinstance(local, int) or local < 1:
        raise ConfigError(f'--nproc must be a positive integer, got {local!r}')
    return nodes, local, argparse.Namespace(**dict(
        vars(args), nproc=nodes.nnodes * local, world_flags=world_flags(nodes, local)))


def world_flags(nodes, local: int) -> Optional[str]:
    """Where a multi-node world size comes from: ``--nnodes N x --nproc K`` (or
    ``SLURM_NNODES=N x --nproc K`` when SLURM gave the node count); None on one node, where
    the world size is ``--nproc`` itself."""
    if nodes.nnodes == 1:
        return None
    slurm = f'SLURM_NNODES={nodes.nnodes}'
    count = slurm if slurm in nodes.sources else f'--nnodes {nodes.nnodes}'
    return f'{count} x --nproc {local}'


def _processes(nproc: int, flags: Optional[str]) -> str:
    """How an error names the world size: ``--nproc K`` on one node, ``N*K processes
    (--nnodes N x --nproc K)`` on several."""
    return f'--nproc {nproc}' if flags is None else f'{nproc} processes ({flags})'


def parallel_section(nproc: int, mode: Optional[str], depth: Optional[int],
                     flags: Optional[str] = None) -> dict:
    """The ``parallel`` dict of tensor parallelism over ``nproc`` processes; a ConfigError
    naming the flags when they do not fit (``flags``: where a multi-node ``nproc`` comes
    from, :func:`world_flags`)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f'--nproc must be a positive integer, got {nproc!r}')
    if depth is not None and mode != '2.5d':
        raise ConfigError(f'--depth applies only to --tensor-mode 2.5d, got --tensor-mode {mode}')
    if nproc == 1 and mode in (None, '1d'):
        return {}
    tensor = dict(size=nproc, mode=mode or '1d')
    if depth is not None:
        tensor['depth'] = depth
    try:
        parse_parallel(dict(tensor=tensor))
    except ConfigError as err:
        raise ConfigError(f'{_processes(nproc, flags)} do{"es" if flags is None else ""} not '
                          f'fit --tensor-mode {tensor["mode"]}'
                          f'{f" --depth {depth}" if depth is not None else ""}: {err}') from None
    return dict(tensor=tensor)


def inference_config(ckpt: str, nproc: int, mode: Optional[str] = None,
                     depth: Optional[int] = None, flags: Optional[str] = None):
    """The validated config of the checkpoint's job under the tensor layout (module doc)."""
    source = {k: v for k, v in job_settings(ckpt).to_dict().items() if k not in TRAINING_ONLY}
    parallel = parallel_section(nproc, mode, depth, flags)
    if parallel:
        source['parallel'] = parallel
    return load_config(source)


def check_model(cfg, nproc: int, flags: Optional[str] = None):
    """The job's model built on the meta device for the layout (rank 0 and the last rank):
    a ConfigError naming the split that fails (and ``flags``, :func:`world_flags`). Returns
    rank 0's meta model."""
    spec, layout = resolve_vocab(cfg.settings.job), cfg.settings.layout.with_world_size(nproc)
    models = {}
    for rank in sorted({0, nproc - 1}):
        try:
            models[rank] = describe_model(spec, layout, rank)
        except ValueError as err:
            over = f'{nproc} process(es)' + (f' ({flags})' if flags else '')
            raise ConfigError(f'the checkpoint\'s {spec.kind} model cannot be split over '
                              f'{over} in tensor mode {layout.mode}: {err}') from None
    return models[0]


def job_tokenizer(spec):
    """``(encode(text) -> list of ids, decode(ids) -> text)`` of a text job: UTF-8 bytes for
    ``shakespeare``; for ``hf`` the job's tokenizer (``data/hf.py``: the file, or the BPE
    trained into ``train.run_dir``, retrained from the job's text when it is not there)."""
    if spec.data_type == 'shakespeare':
        tok = ByteTokenizer()
        return (lambda text: tok.encode(text).tolist()), tok.decode
    if spec.data_type == 'hf':
        texts = None if spec.data.tokenizer.type == 'file' else load_texts(spec.data)
        tok = get_tokenizer(spec.data, texts, spec.run_dir)
        return (lambda text: tok.encode(text).ids), (lambda ids: tok.decode(list(ids)))
    raise ConfigError(f'the checkpoint\'s job trains on data type {spec.data_type!r}, which has '
                      f'no tokenizer: generation needs a text job (shakespeare or hf)')


def check_world(check, nproc: int, flags: Optional[str]):
    """``check()``; a ConfigError it raises names the world size and, on several nodes, the
    flags it comes from (``flags``, :func:`world_flags`) -- the checks below name sizes of the
    layout only."""
    try:
        return check()
    except ConfigError as err:
        if flags is None:
            raise
        raise ConfigError(f'on {nproc} processes ({flags}): {err}') from None


def fail(what: str, ckpt: str, err: Exception) -> int:
    """Print the parent-side error of command ``what`` and return exit status 2."""
    kind = 'not supported' if isinstance(err, NotImplementedError) else 'cannot run'
    print(f'colossal-lite {what}: {kind} on {ckpt}: {err}', file=sys.stderr)
    return 2


PARENT_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotImplementedError)


def launch_worker(ckpt: str, nproc: int, mode: Optional[str], depth: Optional[int]):
    """On a worker: launch the checkpoint's job under the tensor layout, build its model and
    load the checkpoint's weights into it (collective). Returns ``(cfg, model)``; the caller
    ends with ``gpc.destroy()``."""
    cfg = inference_config(ckpt, nproc, mode, depth)
    launch(cfg)
    model = build_model(resolve_vocab(cfg.settings.job)).to(gpc.device)
    load_model(ckpt, model)
    return cfg, model
