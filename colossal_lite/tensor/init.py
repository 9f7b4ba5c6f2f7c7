"""Parameters whose initial value is a pure function of (seed, serial name).

Layers create parameters through :func:`new_parameter` with an ``init(tensor,
generator)`` recipe and a :class:`Placement`. Two ways to get values:

* **by name** (model_zoo models; any model built inside :func:`init_by_name`): the
  layers are constructed on the meta device, then :func:`materialize` walks
  ``named_parameters()`` and, for each, draws the *full* tensor on the CPU from a
  generator seeded with ``hash(seed, name)``, keeps this rank's shard and frees
  the rest. So the serial model, every tensor layout and a pipeline stage holding
  only some layers start from identical weights, nothing is drawn for a layer a rank
  does not hold, and the peak during the build is the rank's shards plus the
  largest single full parameter. The seed defaults to ``torch.initial_seed()``,
  which ``launch(seed=S)`` (or ``torch.manual_seed(S)``) sets.
* **immediately** (a layer built on its own outside a meta context): the full
  tensor is drawn from the default generator, which ``launch`` seeds identically on
  every rank, and cut.

Under a user's own ``torch.device('meta')`` nothing is drawn at all: the model can
be inspected (shapes, placements, bytes per rank) and materialized later.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from ..config.families import family
from ..context import ParallelMode, current_context
from ..context.layout import mode_axes
from .adjacent import ADJACENT_ATTR, place_tagged
from .placement import AxisOrMode, Placement, param_placement, placement_of, set_placement

Init = Callable[[torch.Tensor, Optional[torch.Generator]], object]
INIT_ATTR = 'init_fn'


def building_on_meta() -> bool:
    """Whether tensors created now land on the meta device (``with torch.device('meta')``)."""
    return torch.get_default_device().type == 'meta'


def _replication(cuts: Tuple) -> Tuple[Tuple[ParallelMode, ...], Tuple[ParallelMode, ...]]:
    """(replicated, grad_sum) of a parameter cut by ``cuts`` in the current context. An
    expert parameter (cut over EXPERT) is replicated over, and its gradient summed over,
    EXPERT_DATA instead of DATA (SEQUENCE_DP)."""
    ctx = current_context()
    layout = ctx.layout
    if layout is None:
        return (), ()
    axes = mode_axes(layout)
    cut_axes = {name for _, mode in cuts for name in axes[mode]}
    fam = family(layout.mode)
    single = [m for m, varying in fam.groups.items() if len(varying) == 1]
    expert = any(mode is ParallelMode.EXPERT for _, mode in cuts)
    data_mode = ParallelMode.EXPERT_DATA if expert else ParallelMode.DATA
    replicated = [m for m in [data_mode] + single
                  if ctx.axis(m).size > 1 and not set(axes[m]) & cut_axes]
    grad_mode = ParallelMode.SEQUENCE_DP if fam.splits_sequence else ParallelMode.DATA
    grad_mode = ParallelMode.EXPERT_DATA if expert else grad_mode
    grad_sum = (grad_mode,) if ctx.axis(grad_mode).size > 1 else ()
    return tuple(replicated), grad_sum


def parameter_placement(shape: Sequence[int], *cuts: Tuple[int, AxisOrMode]) -> Placement:
    """The placement of a parameter cut by ``cuts`` (replication and gradient groups filled
    in from the current context)."""
    cut_only = Placement.of(shape, *cuts)
    replicated, grad_sum = _replication(cut_only.cuts)
    return Placement(cut_only.shape, cut_only.cuts, replicated, grad_sum)


def new_parameter(shape: Sequence[int], *cuts: Tuple[int, AxisOrMode], init: Init,
                  dtype: Optional[torch.dtype] = None) -> nn.Parameter:
    """A parameter of full ``shape`` cut by ``cuts``, tagged with its placement and ``init``:
    on the meta device when building on meta, else drawn now (see module doc)."""
    placement = parameter_placement(shape, *cuts)
    dtype = dtype or torch.get_default_dtype()
    if building_on_meta():
        data = torch.empty(placement.local_shape(), dtype=dtype, device='meta')
    else:
        full = torch.empty(placement.shape, dtype=dtype)
        with torch.no_grad():
            init(full, None)
        data = placement.shard(full)
    param = nn.Parameter(data)
    setattr(param, INIT_ATTR, init)
    return set_placement(param, placement)


def tied_or_new_parameter(weight: Optional[nn.Parameter], shape: Sequence[int],
                          *cuts: Tuple[int, AxisOrMode], init: Init,
                          dtype: Optional[torch.dtype] = None) -> nn.Parameter:
    """``weight`` itself when given (a tied weight, which must already be cut by ``cuts``),
    else a :func:`new_parameter`."""
    if weight is None:
        return new_parameter(shape, *cuts, init=init, dtype=dtype)
    want = parameter_placement(shape, *cuts)
    have = param_placement(weight)
    if have.cuts != want.cuts or tuple(weight.shape) != want.local_shape():
        raise ValueError(f'a tied weight must be cut as {want.cuts} with local shape '
                         f'{want.local_shape()}, got {have.cuts} and {tuple(weight.shape)}')
    return weight


# ---------------------------------------------------------------------------- by name
def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, parameter name), the same on every machine."""
    digest = hashlib.sha256(f'{int(seed)}/{name}'.encode()).digest()
    return int.from_bytes(digest[:8], 'little') & ((1 << 63) - 1)


def _replace_parameter(module: nn.Module, old: nn.Parameter, new: nn.Parameter):
    for sub in module.modules():
        for key, value in sub._parameters.items():
            if value is old:
                sub._parameters[key] = new


def materialize(module: nn.Module, seed: Optional[int] = None,
                device: Optional[torch.device] = None) -> nn.Module:
    """Give every meta parameter of ``module`` its value by name (see module doc).

    Tied parameters are drawn once, under their first name (as ``named_parameters``
    lists them). A plain torch submodule built on meta is reset with its own
    ``reset_parameters`` under a generator seeded by its name. Parameters tagged by
    ``adjacent.place_adjacent`` are then laid back to back. Returns ``module``.
    """
    seed = torch.initial_seed() if seed is None else int(seed)
    device = device or current_context().device
    for name, param in list(module.named_parameters()):
        if not param.is_meta:
            continue
        init = getattr(param, INIT_ATTR, None)
        if init is None:
            continue  # plain torch parameter: reset by its module below
        placement = placement_of(param)
        full = torch.empty(placement.shape, dtype=param.dtype)
        with torch.no_grad():
            init(full, torch.Generator().manual_seed(name_seed(seed, name)))
        local = placement.shard(full).to(device)
        if local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() \
                and local.numel() < full.numel():
            local = local.clone()  # a view would keep the full tensor's storage alive
        new = nn.Parameter(local, requires_grad=param.requires_grad)
        del full
        setattr(new, INIT_ATTR, init)
        if hasattr(param, ADJACENT_ATTR):
            setattr(new, ADJACENT_ATTR, getattr(param, ADJACENT_ATTR))
        set_placement(new, placement)
        _replace_parameter(module, param, new)
    _reset_plain_modules(module, seed, device)
    place_tagged(module)
    return module


def _reset_plain_modules(module: nn.Module, seed: int, device):
    for name, sub in module.named_modules():
        tensors = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        if not any(t.is_meta for t in tensors):
            continue
        if not hasattr(sub, 'reset_parameters'):
            raise ValueError(f"module '{name}' ({type(sub).__name__}) was built on the meta "
                             f'device without an init recipe or reset_parameters(); build it '
                             f'from colossal_lite.nn layers or outside the meta device')
        sub.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, name))
            sub.reset_parameters()
        for param in sub.parameters(recurse=False):
            set_placement(param, Placement(tuple(param.shape)))


@contextlib.contextmanager
def init_by_name(module: nn.Module, seed: Optional[int] = None) -> Iterator[None]:
    """Build ``module``'s layers inside: on exit every parameter is drawn by its name
    (:func:`materialize`) -- unless the caller is itself building on meta, who then
    materializes (or inspects) the whole model."""
    outer_meta = building_on_meta()
    with torch.device('meta'):
        yield
    if not outer_meta:
        materialize(module, seed)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of this rank's (deduplicated) parameters; works on meta models."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def placements(module: nn.Module) -> Dict[str, Placement]:
    """Every parameter's placement by serial name (tied parameters under each name)."""
    return {name: param_placement(p)
            for name, p in module.named_parameters(remove_duplicate=False)}
