"""``save`` / ``load``: atomic checkpoint directories written by ``torch.distributed.checkpoint``.

Directory (see docs/checkpoint.md)::

    dir/
      .metadata, __<rank>_<i>.distcp   DCP: every 'model.<key>' and 'optim.<name>.<slot>'
                                       tensor at its full (serial) shape, each written once
      common.pt                        rank 0: global step, AMP, optimizer hyperparameters,
                                       LR scheduler, data position, layout, world size,
                                       ``extra``
      rng_<rank>.pt                    each rank: its CPU/CUDA and per-mode RNG states

Everything in it is data (``files.py``): the side files hold only tensors and plain
containers and are read with ``torch.load(weights_only=True)``, DCP's ``.metadata`` with an
unpickler that knows only DCP's metadata classes; a file needing anything else is refused.

Save: every rank describes its tensors (``state.sharded_tensor_state``: DTensor views of
its shards over the layout's DeviceMesh; full tensors, gathered, where there is no view,
e.g. ZeRO slices) and calls ``dcp.save`` into ``dir.tmp-<uuid>`` (the uuid broadcast
from rank 0 over GLOBAL); DCP's planner keeps one writer per distinct chunk, so a chunk
replicated over DATA (or a tied weight on two pipeline stages) is written once. After a
barrier rank 0 renames the old ``dir`` aside, renames the new one to ``dir`` and deletes
the old one; a final barrier ends the call. A crash before the rename leaves the
previous ``dir`` untouched; one between the two renames leaves it at ``dir.old-<uuid>``,
where :func:`load` (``files.complete_dir``) finds it and the next commit removes it.

A save that fails (an exception on any rank: creating the directory, DCP's writes, the side
files, the commit) is agreed on by every rank at the step's end (:func:`_settle`: one
all_reduce over GLOBAL in place of the barrier that was there, so a rank that failed never
leaves its peers waiting); rank 0, which created ``dir.tmp-<uuid>``, then removes it and
every rank raises (the failed ranks their own error, the others a ``RuntimeError`` naming the
failed ranks). A process that crashes cannot clean up: the next successful commit to the same
``dir`` removes the ``dir.tmp-*`` it left.

Load: every rank reads the index and asks DCP for its own keys (its stage's model keys
and its parameters' optimizer slots) as DTensors with its own placements, so DCP reads
the overlapping saved chunks (``state.sharded_targets`` / ``load_sharded_tensor_state``):
any layout loads any other. Without a launched process group (a plain serial script)
the same keys go as full tensors. RNG states are restored only when the layout and
world size equal the saved ones (they depend on the rank's place). The data position
(``dataloader.state_dict()``: epoch and global samples read, the same on every rank) is
checked against the loader before any collective (ValueError when it cannot continue
there, e.g. a position that is not a whole number of its global batches).
"""
from __future__ import annotations

import glob
import os
import shutil
import uuid
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import colossal_lite.checkpoint.state as S

from ..communication import collective as C
from ..context import ParallelMode, current_context
from ..tensor import layout_mesh
from .files import COMMON, SafeReader, moved_aside, plain, read, resolve, rng_file, write


# what a failed step of a save raises: DCP's CheckpointException (every rank's errors of a
# DCP step, raised on every rank) is a BaseException
SAVE_ERRORS = (Exception, dcp.CheckpointException)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier():
    if _distributed():
        C.barrier(ParallelMode.GLOBAL)


def _shared_token() -> str:
    """A uuid chosen by rank 0 and broadcast to every rank."""
    token = uuid.uuid4().hex
    if not _distributed():
        return token
    buf = torch.tensor(list(token.encode()), dtype=torch.uint8, device=current_context().device)
    buf = C.broadcast(buf, ParallelMode.GLOBAL, src=0)
    return bytes(buf.cpu().tolist()).decode()


def _layout_signature() -> str:
    ctx = current_context()
    return repr(ctx.layout) if ctx is not None and ctx.layout is not None else 'serial'


def _views() -> Optional[S.DTensorViews]:
    """DTensor views over the launched layout's mesh (collective), None when serial."""
    ctx = current_context()
    if not _distributed() or ctx.layout is None:
        return None
    return S.DTensorViews(layout_mesh(ctx.layout), ctx.layout)


def _check_dataloader(dataloader):
    if dataloader is not None and not (hasattr(dataloader, 'state_dict')
                                       and hasattr(dataloader, 'check_state')):
        raise TypeError(f'dataloader= needs a loader with a position (state_dict, check_state, '
                        f'load_state_dict: colossal_lite.data.DataParallelLoader), got '
                        f'{type(dataloader).__name__}')


def _settle(error: Optional[BaseException], tmp: Optional[str], what: str) -> None:
    """The end of one step of a save, on every rank (collective: it is the step's barrier):
    whether any rank's ``error`` is set, agreed by one all_reduce of a per-rank flag over
    GLOBAL. If any rank failed, rank 0 removes ``tmp`` (it created it, and every rank is past
    its writes into it) and every rank raises: its own error, or a ``RuntimeError`` naming
    the ranks that failed ``what``."""
    failed = [0] if error is not None else []
    if _distributed():
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32,
                            device=current_context().device)
        flags[dist.get_rank()] = int(error is not None)
        flags = C.all_reduce(flags, ParallelMode.GLOBAL)
        failed = [r for r, f in enumerate(flags.cpu().tolist()) if f]
    if not failed:
        return
    if _rank() == 0 and tmp is not None:
        _discard(tmp)
    if error is not None:
        raise error
    raise RuntimeError(f'checkpoint save failed while {what} on rank(s) {failed} (their own '
                       f'errors name the cause); {tmp or "the new checkpoint"} was removed and '
                       f'the previous checkpoint, if any, is unchanged')


def _discard(folder: str) -> None:
    """Remove an uncommitted ``path.tmp-*`` folder; a failure to do so is a warning (the next
    commit to the same path removes it)."""
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        pass
    except OSError as err:
        warnings.warn(f'could not remove the unfinished checkpoint folder {folder}: {err}')


def _stale(path: str):
    """The ``path.tmp-<uuid>`` folders of saves to ``path`` that never committed."""
    return glob.glob(glob.escape(path) + '.tmp-*')


def _commit(tmp: str, path: str) -> None:
    """Rank 0: put the complete ``tmp`` at ``path``; the old checkpoint is removed last (with
    any ``path.old-*`` an earlier crash between these two renames left, and any
    ``path.tmp-*`` a save that crashed before its commit left)."""
    if os.path.exists(path):
        os.rename(path, f'{path}.old-{uuid.uuid4().hex}')
    os.rename(tmp, path)
    for old in moved_aside(path):
        shutil.rmtree(old)
    for stale in _stale(path):
        _discard(stale)


class AsyncSave:
    """A save whose shard writes run in DCP's background thread (``dcp.async_save``; the
    tensors were copied to CPU memory before :func:`save` returned, so training may go on).
    :meth:`wait` (collective) completes it: waits for this rank's writes, a barrier, then
    the atomic rename. The next :func:`save` or :func:`load` calls it first."""

    def __init__(self, future, tmp: str, path: str):
        self._future, self.tmp, self.path = future, tmp, path
        self.done = False

    def wait(self) -> None:
        global _pending
        if self.done:
            return
        self.done = True
        if _pending is self:
            _pending = None
        error = None
        try:
            self._future.result()
        except SAVE_ERRORS as err:  # noqa: BLE001 -- agreed on by every rank in _finish
            error = err
        _finish(self.tmp, self.path, error)


_pending: Optional[AsyncSave] = None
_async_groups: dict = {}


def wait() -> None:
    """Complete the pending async save, if any (collective)."""
    if _pending is not None:
        _pending.wait()


def _async_group():
    """A gloo group over all ranks for DCP's background thread (its plan exchange must not
    interleave with the training's collectives on the default group); one per run."""
    if not _distributed():
        return None
    default = dist.group.WORLD
    if id(default) not in _async_groups:
        _async_groups.clear()
        _async_groups[id(default)] = dist.new_group(backend='gloo')
    return _async_groups[id(default)]


def _cpu_copies(flat: dict) -> dict:
    """A copy in CPU memory of every tensor (a DTensor stays a DTensor over the same mesh):
    what the background writer reads while training changes the originals."""
    return {k: v.detach().to('cpu', copy=True) for k, v in flat.items()}


class _Staged:
    """DCP stager for a state dict that :func:`_cpu_copies` staged already (DCP's default
    stager deep-copies DTensors, which fails on views of our parameters)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self):
        pass

    def close(self):
        pass


def _finish(tmp: str, path: str, error: Optional[BaseException] = None) -> None:
    """Every rank wrote its part of ``tmp`` (or failed with ``error``): agreed by every rank
    (:func:`_settle`, the barrier), rank 0 commits, agreed again."""
    _settle(error, tmp, f'writing {tmp}')
    error = None
    if _rank() == 0:
        try:
            _commit(tmp, path)
        except SAVE_ERRORS as err:  # noqa: BLE001 -- agreed on by every rank below
            error = err
    _settle(error, tmp if os.path.isdir(tmp) else None, f'putting {tmp} at {path}')


def save(path: str, engine, lr_scheduler=None, dataloader=None, extra: Any = None,
         async_save: bool = False) -> Optional[AsyncSave]:
    """Write the engine's training state to directory ``path`` (collective, atomic). With
    ``async_save`` the shard files are written in the background and the returned
    :class:`AsyncSave` puts the directory in place when waited for (see there)."""
    wait()
    _check_dataloader(dataloader)
    S.check_supported(engine)
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f'the checkpoint directory\'s parent {parent} does not exist')
    # data only (files.plain), checked on every rank before any collective
    common = plain(dict(S.side_state(engine, lr_scheduler), extra=extra,
                        dataloader=None if dataloader is None else dataloader.state_dict(),
                        layout=_layout_signature(),
                        world_size=dist.get_world_size() if _distributed() else 1), COMMON)
    tmp = f'{path}.tmp-{_shared_token()}'
    views = _views()
    flat = S.tensor_state(engine) if views is None else S.sharded_tensor_state(engine, views)
    rank, error, future = _rank(), None, None
    if rank == 0:
        try:
            os.makedirs(tmp)
        except OSError as err:
            error = err
    _settle(error, None, f'creating {tmp}')   # the barrier: tmp exists on every rank
    try:  # a failure is agreed on below; DCP itself raises a rank's write error on every rank
        writer = dcp.FileSystemWriter(tmp)
        if async_save:
            future = dcp.async_save(_cpu_copies(flat), storage_writer=writer,
                                    process_group=_async_group(), async_stager=_Staged())
        else:
            dcp.save(flat, storage_writer=writer)
        write(S.rng_state(), os.path.join(tmp, rng_file(rank)))
        if rank == 0:
            write(common, os.path.join(tmp, COMMON))
    except SAVE_ERRORS as err:  # noqa: BLE001 -- every rank raises in _settle / _finish
        error = err
    if not async_save:
        _finish(tmp, path, error)
        return None
    failed, futureless = _count(error is not None, future is None)
    if failed:  # the background writes end before rank 0 removes tmp -- unless a rank has
        if future is not None and not futureless:  # none: then DCP's first exchange waits
            try:                                     # for it, before any write, for good
                future.result()
            except SAVE_ERRORS:  # noqa: BLE001 -- the save failed already
                pass
        _settle(error, tmp, f'writing {tmp}')
    global _pending
    _pending = AsyncSave(future, tmp, path)
    return _pending


def _count(*flags: bool) -> list:
    """How many ranks have each flag set (one all_reduce over GLOBAL)."""
    if not _distributed():
        return [int(f) for f in flags]
    counts = torch.tensor([int(f) for f in flags], dtype=torch.int32,
                          device=current_context().device)
    return C.all_reduce(counts, ParallelMode.GLOBAL).cpu().tolist()


def load_tensors(path: str, engine) -> None:
    """Read the tensors ``engine`` owns (``engine.model``, ``engine.optimizer``, ``engine.amp``
    as ``state.py`` reads them) from the complete checkpoint at ``path`` (collective): DTensor
    targets over the layout's mesh when launched, so DCP reads only the overlapping saved
    chunks; full tensors in a serial process without a process group."""
    reader = SafeReader(path)  # the index read as data (files.py)
    saved = reader.read_metadata().state_dict_metadata
    views = _views()
    if views is None:
        flat = {key: torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
                for key in S.wanted_keys(engine, saved)}
        dcp.load(flat, storage_reader=reader)
        S.load_tensor_state(engine, flat)
    else:
        flat = S.sharded_targets(engine, saved, views)
        dcp.load(flat, storage_reader=reader)
        S.load_sharded_tensor_state(engine, flat)


def load(path: str, engine, lr_scheduler=None, dataloader=None) -> Any:
    """Load the checkpoint at ``path`` into ``engine`` in its own layout (collective);
    returns the ``extra`` given to :func:`save`. ``path`` may have been left at
    ``path.old-<uuid>`` by a crash during a save's commit (``files.complete_dir``)."""
    wait()
    _check_dataloader(dataloader)
    S.check_supported(engine)
    path = resolve(path)
    common = read(os.path.join(path, COMMON))  # data only (files.py), before any collective
    if not isinstance(common, dict) or not {'global_step', 'layout', 'world_size'} <= set(common):
        raise ValueError(f'{os.path.join(path, COMMON)} is not the common state of a checkpoint')
    if dataloader is not None:  # before any collective: a position this loader cannot take
        if common.get('dataloader') is None:
            raise ValueError(f'{path} holds no data position (saved without dataloader=)')
        dataloader.check_state(common['dataloader'])
    world = dist.get_world_size() if _distributed() else 1
    rng_path = None  # RNG states only into the same layout (they depend on the rank's place)
    if common['layout'] == _layout_signature() and common['world_size'] == world:
        rng_path = os.path.join(path, rng_file(_rank()))
        rng = read(rng_path)
    load_tensors(path, engine)
    S.load_side_state(engine, common, lr_scheduler)
    if dataloader is not None:
        dataloader.load_state_dict(common['dataloader'])
    if rng_path is not None:
        S.load_rng_state(rng, rng_path)
    _barrier()
    return common['extra']
