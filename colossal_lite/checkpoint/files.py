"""The files of a checkpoint directory, read as data: nothing in a checkpoint runs code.

A config file is code (it is run, as in every peer); a checkpoint is data, and may come
from someone else. Loading it must never execute anything it holds, so its pickles are
read with restricted unpicklers:

* **Side files** (``common.pt``, ``rng_<rank>.pt``) are written with ``torch.save`` and read
  with ``torch.load(weights_only=True)`` (:func:`read`): tensors, ``dict`` / ``list`` /
  ``tuple`` / ``set`` and ``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes``,
  ``torch.dtype``, ``torch.device`` -- no other Python object. :func:`write` converts
  mappings and sequences to those containers and names the first other value (a
  ``TypeError`` at save time, e.g. ``extra['fn']``). A file that needs any other object to
  be read -- a planted ``__reduce__``, or a checkpoint of an earlier colossal_lite whose RNG
  file keyed its streams by ``ParallelMode`` objects -- is refused with
  :class:`UnsafeCheckpointError` naming the file and the object; :func:`upgrade` rewrites
  an old checkpoint you trust.
* **DCP's index** (``.metadata``): torch reads it with a plain ``pickle.load``.
  :class:`SafeReader` (a ``FileSystemReader``) reads it with an unpickler that knows only
  DCP's metadata classes, ``torch.Size``, dtypes and paths, and refuses byte entries
  (DCP would read those with ``torch.load(weights_only=False)``; colossal_lite writes
  none) and data files outside the directory. DCP reads the shard files themselves with
  ``weights_only=True``.

**Where the last complete checkpoint is** (:func:`complete_dir`): a save commits by two
renames on rank 0 (``dir`` -> ``dir.old-<uuid>``, then ``dir.tmp-<uuid>`` -> ``dir``); a
crash between them leaves the previous checkpoint at ``dir.old-<uuid>``, which
:func:`complete_dir` finds when ``dir`` holds none. The next commit removes it.
"""
from __future__ import annotations

import collections.abc
import glob
import os
import pathlib
import pickle
import re
from typing import Any, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md

from ..context import ParallelMode

COMMON = 'common.pt'


def rng_file(rank: int) -> str:
    return f'rng_{rank}.pt'


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that could run code if it were read (module doc)."""


# ---------------------------------------------------------------------- where it is
def moved_aside(path: str) -> List[str]:
    """The ``path.old-<uuid>`` directories a commit moved the previous checkpoint to."""
    return glob.glob(glob.escape(os.path.abspath(os.fspath(path))) + '.old-*')


def _holds_one(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMMON))


def complete_dir(path: str) -> Optional[str]:
    """The directory holding the last complete checkpoint saved to ``path``: ``path`` itself,
    else the newest complete ``path.old-<uuid>`` (a crash between a commit's two renames);
    None when there is none."""
    path = os.path.abspath(os.fspath(path))
    if _holds_one(path):
        return path
    moved = [d for d in moved_aside(path) if _holds_one(d)]
    if not moved:
        return None
    return max(moved, key=lambda d: os.path.getmtime(os.path.join(d, COMMON)))


def resolve(path: str) -> str:
    """:func:`complete_dir`, or a ``FileNotFoundError`` naming ``path``."""
    found = complete_dir(path)
    if found is None:
        raise FileNotFoundError(f'{os.path.abspath(os.fspath(path))} is not a complete '
                                f'checkpoint (no {COMMON})')
    return found


# ---------------------------------------------------------------------- side files
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain(value: Any, where: str) -> Any:
    """``value`` as what ``torch.load(weights_only=True)`` reads back: mappings as ``dict``,
    lists, tuples and sets as themselves, exact scalar types and plain tensors; a
    ``TypeError`` naming ``where`` (e.g. ``common.pt: extra['fn']``) for anything else."""
    if type(value) in _LEAVES or type(value) in _TENSORS:
        return value
    if isinstance(value, collections.abc.Mapping):
        return {plain(k, f'{where} (a key)'): plain(v, f'{where}[{k!r}]')
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):  # a namedtuple as a tuple
        kind = tuple if isinstance(value, tuple) else list if isinstance(value, list) else set
        return kind(plain(v, f'{where}[{i}]') for i, v in enumerate(value))
    raise TypeError(f'{where} is a {type(value).__module__}.{type(value).__qualname__}: a '
                    f'checkpoint holds data only (tensors, dicts, lists, tuples, str, int, '
                    f'float, bool, None), which any reader loads without running code '
                    f'(docs/checkpoint.md)')


def write(obj: Any, path: str) -> None:
    """``torch.save`` of :func:`plain` ``obj`` (checked before anything is written)."""
    obj = plain(obj, os.path.basename(path))
    torch.save(obj, path)


_GLOBAL = re.compile(r'GLOBAL ([\w.]*\w)')


def read(path: str) -> Any:
    """A side file read as data (``torch.load(weights_only=True)``, to CPU); one that needs
    any Python object to be read is refused with :class:`UnsafeCheckpointError`."""
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as err:
        found = _GLOBAL.search(str(err))
        name = found.group(1) if found else None
        what = (f'the Python object {name}' if name else
                f'something other than data ({str(err).strip().splitlines()[-1][:200]})')
        why = ('A checkpoint written by an earlier colossal_lite keyed its RNG states by '
               'ParallelMode objects: if you trust this one, rewrite its side files once with '
               'colossal_lite.checkpoint.upgrade(DIR)' if (name or '').startswith('colossal_lite.')
               else 'colossal_lite never writes such a file: do not load it')
        raise UnsafeCheckpointError(
            f'{path}: refused: reading it needs {what}, and unpickling that could run code. '
            f'A checkpoint is data: its side files are read with torch.load(weights_only=True) '
            f'and hold only tensors and plain containers (docs/checkpoint.md). {why}') from None


def upgrade(path: str) -> List[str]:
    """Rewrite the side files of a checkpoint written by an earlier colossal_lite in today's
    format; returns the files rewritten. It unpickles them fully (``weights_only=False``):
    run it only on a checkpoint you trust."""
    folder, done = resolve(path), []
    for name in sorted(os.listdir(folder)):
        if name != COMMON and not re.fullmatch(r'rng_\d+\.pt', name):
            continue
        file = os.path.join(folder, name)
        try:
            read(file)
            continue  # already data
        except UnsafeCheckpointError:
            pass
        obj = torch.load(file, map_location='cpu', weights_only=False)  # trusted by the caller
        if name != COMMON and isinstance(obj, dict) and isinstance(obj.get('modes'), dict):
            obj['modes'] = {(m.value if isinstance(m, ParallelMode) else m): list(s)
                            for m, s in obj['modes'].items()}
        write(obj, file)
        done.append(file)
    return done


# ---------------------------------------------------------------------- DCP's index
_DCP_CLASSES = {('torch.distributed.checkpoint.metadata', n): getattr(_dcp_md, n) for n in (
    'Metadata', 'TensorStorageMetadata', 'ChunkStorageMetadata', 'TensorProperties',
    'MetadataIndex', 'StorageMeta', '_MEM_FORMAT_ENCODING', 'BytesStorageMetadata')}
_DCP_CLASSES[('torch.distributed.checkpoint.filesystem', '_StorageInfo')] = _dcp_fs._StorageInfo
_DCP_CLASSES.update({('torch', 'Size'): torch.Size,
                     ('torch.serialization', '_get_layout'): torch.serialization._get_layout,
                     ('pathlib', 'PosixPath'): pathlib.PurePosixPath,  # the save's path:
                     ('pathlib', 'WindowsPath'): pathlib.PureWindowsPath,  # a name only
                     ('pathlib', 'PurePosixPath'): pathlib.PurePosixPath,
                     ('pathlib', 'PureWindowsPath'): pathlib.PureWindowsPath})


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths."""

    def find_class(self, module, name):
        obj = _DCP_CLASSES.get((module, name))
        if obj is None and module == 'torch' and isinstance(getattr(torch, name, None),
                                                            torch.dtype):
            obj = getattr(torch, name)
        if obj is None:
            raise pickle.UnpicklingError(f'{module}.{name}')
        return obj


class SafeReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` whose ``.metadata`` is read as data (module doc)."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get('rank')
        name = '.metadata' if rank is None else f'__{rank}.metadata'
        file = os.path.join(os.fspath(self.path), name)
        with open(file, 'rb') as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpointError(
                    f'{file}: refused: reading it needs the Python object {err}, which is not '
                    f'part of a checkpoint index, and unpickling it could run code (a '
                    f'checkpoint is data; docs/checkpoint.md)') from None
        _check_index(metadata, file)
        if getattr(metadata, 'storage_meta', None) is None:
            metadata.storage_meta = _dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_index(metadata, file: str) -> None:
    """Every entry a tensor, every data file a plain name in the directory."""
    if not isinstance(metadata, _dcp_md.Metadata):
        raise UnsafeCheckpointError(f'{file}: refused: not a checkpoint index '
                                    f'(a {type(metadata).__name__})')
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, _dcp_md.TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f'{file}: refused: entry {key!r} is a {type(entry).__name__}, which DCP would '
                f'unpickle with torch.load(weights_only=False); colossal_lite checkpoints '
                f'hold tensors only')
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, 'relative_path', None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ('', '.', '..'):
            raise UnsafeCheckpointError(f'{file}: refused: a data file {rel!r} outside the '
                                        f'checkpoint directory')
