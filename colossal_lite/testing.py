"""Run a function on N local processes (fork, one thread each) with a launched context.

``run_distributed(fn, world_size, config, *args)`` forks ``world_size``
processes, launches each with ``config`` on a free port (gloo), calls
``fn(rank, *args)`` and returns the list of return values by rank. A child's
exception is re-raised in the parent with its traceback; a child that does not
finish within ``timeout`` seconds makes the call fail, never hang. Results
travel through a pipe (serialized with torch.save), so return small values: CPU
tensors, numbers, dicts and lists of them.
"""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import os
import socket
import time
import traceback
from typing import Any, Callable, List, Optional


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class ChildFailed(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _to_bytes(obj) -> bytes:
    # torch.save, not pickle: tensors pickled by a Queue travel as shared-memory handles
    # tied to the child's lifetime, which can deadlock once the child exits
    import io
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    import io
    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _child(rank, world_size, port, config, fn, args, queue, collective_timeout):
    os.environ['OMP_NUM_THREADS'] = '1'
    import torch
    torch.set_num_threads(1)
    from . import launch
    from .context import global_context as gpc
    try:
        cfg = dict(config or {})
        cfg.setdefault('timeout', collective_timeout)
        launch(cfg, rank=rank, world_size=world_size, host='127.0.0.1', port=port,
               backend='gloo')
        result = fn(rank, *args)
        queue.put((rank, 'ok', _to_bytes(result)))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, 'error', traceback.format_exc()))
    finally:
        try:
            gpc.destroy()
        except Exception:
            pass


_EXIT_GRACE_S = 10.0


def _check_exited(procs, pending, exited_at):
    """Fail for a pending rank that exited: at once on a non-zero code, and after a grace
    period (its result may still be in the pipe) on code 0."""
    now = time.monotonic()
    for r in sorted(pending):
        code = procs[r].exitcode
        if code is None:
            continue
        if code != 0:
            raise ChildFailed(f'rank {r} exited with code {code} without reporting')
        if now - exited_at.setdefault(r, now) > _EXIT_GRACE_S:
            raise ChildFailed(f'rank {r} exited normally but its result never arrived')


def run_distributed(fn: Callable, world_size: int, config: Optional[dict] = None, *args,
                    timeout: float = 120.0, collective_timeout: float = 60.0) -> List[Any]:
    """Fork ``world_size`` launched ranks running ``fn(rank, *args)``; results by rank."""
    ctx = mp.get_context('fork')
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(r, world_size, port, config, fn, args, queue, collective_timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    pending = set(range(world_size))
    exited_at: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f'ranks {sorted(pending)} of {world_size} did not finish '
                                   f'within {timeout:.0f} s')
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                _check_exited(procs, pending, exited_at)
                continue
            if status == 'error':
                raise ChildFailed(f'rank {rank} of {world_size} raised:\n{payload}')
            results[rank] = _from_bytes(payload)
            pending.discard(rank)
    finally:
        for p in procs:
            p.join(timeout=5 if not pending else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results


def full_gradients(model) -> dict:
    """Every parameter's gradient gathered to the serial (full) shape, keyed like state_dict.

    Collective over the tensor-parallel groups: call on every rank."""
    from .tensor import gather_full
    return {name: gather_full(p.grad, p).detach().clone()
            for name, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(actual, expected) -> float:
    """max |actual - expected| / max(1, max |expected|): the suite's fp32 comparison measure
    (infinite when either side holds a NaN or an infinity)."""
    import torch
    actual, expected = torch.as_tensor(actual).float(), torch.as_tensor(expected).float()
    if actual.shape != expected.shape:
        raise AssertionError(f'shape {tuple(actual.shape)} != expected {tuple(expected.shape)}')
    if not expected.numel():
        return 0.0
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return float('inf')  # NaN compares False with any tolerance: never let it pass
    scale = max(1.0, expected.abs().max().item())
    return (actual - expected).abs().max().item() / scale


def assert_close_dict(actual: dict, expected: dict, tol: float = 1e-5, what: str = ''):
    """Same keys, every tensor within ``tol`` (max_rel_diff); the message names the worst key."""
    missing = set(expected) ^ set(actual)
    if missing:
        raise AssertionError(f'{what} keys differ: {sorted(missing)}')
    worst = max(((max_rel_diff(actual[k], expected[k]), k) for k in expected), default=(0.0, None))
    if worst[0] > tol:
        raise AssertionError(f'{what} {worst[1]} differs by {worst[0]:.3g} > {tol}')


def _gather_outputs(outputs):
    from . import nn as col_nn
    if isinstance(outputs, (tuple, list)):
        return tuple(_gather_outputs(o) for o in outputs)
    return col_nn.gather_logits(outputs).detach().clone()


def training_trace(model, inputs, labels, loss_fn, steps: int = 3, lr: float = 1e-3,
                   sync_gradients=None) -> dict:
    """Run ``steps`` AdamW steps and record what the correctness standard compares.

    Works unchanged for a serial model (no launch) and a parallel one (every rank):
    returns the first step's gathered outputs and full gradients, every step's loss, and
    the full state dict after the last step. ``inputs`` is a tuple of positional model
    arguments; ``loss_fn(outputs, labels)``; ``sync_gradients(model)`` runs after each
    backward (e.g. the data-parallel all-reduce). AdamW's eps is 1e-6: gradients that are
    zero in exact arithmetic (attention key biases) carry ~1e-10 rounding noise, which
    eps=1e-8 would amplify into visible parameter differences.
    """
    import torch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6, weight_decay=0.01)
    trace = {'losses': []}
    for step in range(steps):
        optimizer.zero_grad()
        outputs = model(*inputs)
        loss = loss_fn(outputs, labels)
        loss.backward()
        if sync_gradients is not None:
            sync_gradients(model)
        if step == 0:
            trace['outputs'] = _gather_outputs(outputs)
            trace['grads'] = full_gradients(model)
        trace['losses'].append(loss.detach().clone())
        optimizer.step()
    trace['state'] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trace


def assert_traces_match(actual: dict, expected: dict, tol: float = 1e-5):
    """Losses, outputs, gradients and final parameters of two training traces agree."""
    assert_close_dict(dict(enumerate(actual['losses'])), dict(enumerate(expected['losses'])),
                      tol, 'loss at step')
    outs_a, outs_e = actual['outputs'], expected['outputs']
    if not isinstance(outs_e, tuple):
        outs_a, outs_e = (outs_a,), (outs_e,)
    assert_close_dict(dict(enumerate(outs_a)), dict(enumerate(outs_e)), tol, 'output')
    assert_close_dict(actual['grads'], expected['grads'], tol, 'gradient of')
    assert_close_dict(actual['state'], expected['state'], tol, 'parameter after steps:')
