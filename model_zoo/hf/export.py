"""Our model (any layout) -> a directory ``transformers`` ``from_pretrained`` loads.

``save_hf(model, directory)`` is collective:

1. every rank calls ``model.state_dict()``: full tensors over tensor parallelism (the
   layers all-gather their shards over their tensor groups), this rank's pipeline
   stages' keys only;
2. under pipeline parallelism, the pipeline group holding global rank 0 moves every key
   to its pipeline rank 0: one MAX ``all_reduce`` over PIPELINE of a key-owner vector
   (the first stage holding each key, keys and shapes from a serial model built on the
   meta device), then one ``send``/``recv`` per key a later stage owns (other pipeline
   groups hold copies of the same weights and send nothing);
3. global rank 0 cuts the padded vocabulary back to the HF size, maps the keys, loads
   them into the HF model built from the config (a strict load: every HF weight is
   checked) and writes ``config.json`` + ``model.safetensors`` with transformers'
   ``save_pretrained``;
4. one ``broadcast`` over GLOBAL of rank 0's success flag, so every rank returns after the
   files exist, or raises when rank 0 failed.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from colossal_lite import communication as C
from colossal_lite.context import ParallelMode, current_context

from .family import HFFamily, State


def serial_shapes(model) -> List[Tuple[str, torch.Size]]:
    """(key, full shape) of the serial model with ``model``'s constructor arguments, in
    state-dict order (built on the meta device for a described one-rank layout: free)."""
    from colossal_lite.config import parse_parallel
    from colossal_lite.context import ParallelContext, use_context
    layout = parse_parallel({}).with_world_size(1)
    with use_context(ParallelContext.describe(layout, 0)), torch.device('meta'):
        serial = type(model)(**model.arch_args)
    return [(k, v.shape) for k, v in serial.state_dict().items()]


def full_state(model) -> Optional[State]:
    """The full serial state dict on global rank 0 (None elsewhere). Collective."""
    local = model.state_dict()
    ctx = current_context()
    pipe = ctx.axis(ParallelMode.PIPELINE)
    if pipe.size == 1:
        return local if ctx.get_global_rank() == 0 else None
    if 0 not in pipe.ranks:  # another replica's pipeline group: rank 0 gets nothing from it
        return None
    shapes = serial_shapes(model)
    # owner = the first stage holding the key: max over stages of (P - stage) where held
    held = torch.tensor([pipe.size - pipe.rank if k in local else 0 for k, _ in shapes],
                        device=ctx.device)
    owners = pipe.size - C.all_reduce(held, pipe, op=torch.distributed.ReduceOp.MAX)
    dtype = next(iter(local.values())).dtype
    out: Dict[str, torch.Tensor] = {}
    for (key, shape), owner in zip(shapes, owners.tolist()):
        if owner == pipe.size:
            raise RuntimeError(f'no pipeline stage holds {key!r}')
        if pipe.rank == 0:
            out[key] = local[key] if owner == 0 else C.recv(
                torch.empty(shape, dtype=dtype, device=ctx.device), pipe, src=owner)
        elif pipe.rank == owner:
            C.send(local[key], pipe, dst=0)
    return out if pipe.rank == 0 else None


def write(fam: HFFamily, model, state: State, directory: str) -> None:
    """Rank 0's part: the HF model of ``state`` written to ``directory``."""
    import transformers
    args = model.arch_args
    vocab = hf_vocab_size(model)
    if fam.vocab_keys:
        state = {k: v[:vocab] if k in fam.vocab_keys else v for k, v in state.items()}
    class_name, hf_state = fam.to_hf(state, args)
    config = fam.config(args, vocab, getattr(model, 'hf_config', None) or {})
    class_name = class_name or fam.hf_class(config)
    with torch.random.fork_rng(devices=[]):  # HF's random init must not move rank 0's RNG
        hf_model = getattr(transformers, class_name)(config)
    hf_model.load_state_dict({k: v.detach().cpu().contiguous() for k, v in hf_state.items()},
                             strict=True)
    os.makedirs(directory, exist_ok=True)
    hf_model.save_pretrained(directory)


def hf_vocab_size(model) -> Optional[int]:
    """The vocabulary written to HF: the size the model was read with (``from_hf``), else
    its own ``vocab_size`` (None for a model without a vocabulary)."""
    known = getattr(model, 'hf_vocab_size', None)
    return known if known is not None else model.arch_args.get('vocab_size')


def save_hf(fam: HFFamily, model, directory) -> None:
    """Collective: global rank 0 writes ``directory`` (module doc)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f'save_hf takes a directory path, got {type(directory).__name__}')
    if not hasattr(model, 'arch_args'):
        raise ValueError(f'{type(model).__name__} does not record its constructor arguments '
                         f'(arch_args); save_hf needs them to write the HF config')
    vocab = hf_vocab_size(model)
    if vocab is not None and vocab > model.arch_args['vocab_size']:
        raise ValueError(f'hf_vocab_size={vocab} exceeds the model vocab_size='
                         f"{model.arch_args['vocab_size']}")
    state = full_state(model)
    ctx = current_context()
    error = None
    if ctx.get_global_rank() == 0:
        try:
            write(fam, model, state, os.fspath(directory))
        except Exception as exc:  # reported to every rank below, then re-raised here
            error = exc
    ok = C.broadcast(torch.tensor([0 if error else 1], device=ctx.device), ParallelMode.GLOBAL,
                     src=0)
    if error is not None:
        raise error
    if not int(ok.item()):
        raise RuntimeError(f'save_hf: global rank 0 failed to write {os.fspath(directory)!r} '
                           f'(its error is raised there)')
