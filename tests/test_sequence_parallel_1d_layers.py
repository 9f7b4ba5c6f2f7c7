"""The machinery under 1D sequence parallelism, layer by layer (whole models: test_llama.py,
test_models_1d.py):

* ``partial_grad_param``: the gradient of a weight used on this rank's tokens is summed over
  the group -- by one bucketed all_reduce at the end of the backward pass when nothing
  observes it earlier, at once otherwise (a post-accumulate-grad hook, autograd.grad);
* the column linear in rank-major order (output narrower than 1.5x the input) and in
  batch-first order (wider), the row linear and the vocab-parallel embedding equal the
  serial layers on the full sequence, with the same bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from colossal_lite.communication import comm_profile, partial_grad_param
from colossal_lite.context import ParallelMode as PM, global_context as gpc
from colossal_lite.testing import max_rel_diff, run_distributed

TOL = 1e-6
SP2 = dict(parallel=dict(tensor=dict(size=2, mode='1d', sequence_parallel=True)))


# ---------------------------------------------------------------- partial_grad_param
def _weights():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 4)]


def _local_loss(weights, rank, use=lambda w: w):
    """A loss whose gradient for each weight differs by rank (its own tokens)."""
    x = torch.arange(1.0, 6.0) * (rank + 1)
    return sum((use(w) * x[:w.numel()]).square().sum() for w in weights)


def _partial_grad_run(rank):
    axis = gpc.axis(PM.PARALLEL_1D)
    out = {}
    # the reference: each rank's own gradient, summed by hand
    ref = _weights()
    _local_loss(ref, rank).backward()
    expected = [p.grad.clone() for p in ref]
    for p in expected:
        torch.distributed.all_reduce(p, group=axis.group)

    weights = _weights()
    with comm_profile() as stats:
        _local_loss(weights, rank, lambda w: partial_grad_param(w, axis)).backward()
    out['deferred'] = dict(grads=[p.grad.clone() for p in weights], expected=expected,
                           calls=stats.calls(axis.mode, 'all_reduce'),
                           bytes=stats.bytes(axis.mode, 'all_reduce'))
    # a second backward accumulates: .grad = first + second sum
    with comm_profile() as stats:
        _local_loss(weights, rank, lambda w: partial_grad_param(w, axis)).backward()
    out['accumulated'] = dict(grads=[p.grad.clone() for p in weights],
                              calls=stats.calls(axis.mode, 'all_reduce'))
    # a post-accumulate-grad hook on the first weight: it is summed at once and the hook
    # sees the sum; the other two still share one bucket
    weights = _weights()
    seen = []
    weights[0].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    with comm_profile() as stats:
        _local_loss(weights, rank, lambda w: partial_grad_param(w, axis)).backward()
    out['hooked'] = dict(grads=[p.grad.clone() for p in weights], seen=seen,
                         calls=stats.calls(axis.mode, 'all_reduce'))
    # torch.autograd.grad: nothing accumulates, every gradient is returned summed
    weights = _weights()
    with comm_profile() as stats:
        grads = torch.autograd.grad(
            _local_loss(weights, rank, lambda w: partial_grad_param(w, axis)), weights)
    out['autograd_grad'] = dict(grads=list(grads), calls=stats.calls(axis.mode, 'all_reduce'),
                                untouched=all(p.grad is None for p in weights))
    return out


def test_partial_grad_param_sums_in_one_bucket_or_at_once_when_observed():
    for r in run_distributed(_partial_grad_run, 2, SP2):
        expected = r['deferred']['expected']
        deferred = r['deferred']
        assert deferred['calls'] == 1 and deferred['bytes'] == 4 * (3 + 5 + 4)
        for got, want in zip(deferred['grads'], expected):
            assert torch.equal(got, want)
        assert r['accumulated']['calls'] == 1
        for got, want in zip(r['accumulated']['grads'], expected):
            assert torch.equal(got, want + want)
        hooked = r['hooked']
        assert hooked['calls'] == 2   # the hooked weight at once, the other two bucketed
        assert len(hooked['seen']) == 1 and torch.equal(hooked['seen'][0], expected[0])
        for got, want in zip(hooked['grads'], expected):
            assert torch.equal(got, want)
        grad = r['autograd_grad']
        assert grad['calls'] == 3 and grad['untouched']
        for got, want in zip(grad['grads'], expected):
            assert torch.equal(got, want)


# ---------------------------------------------------------------- layers on the full sequence
def _layers_run(rank):
    from colossal_lite.nn.parallel_1d import (ColumnLinear1D, RowLinear1D,
                                              VocabParallelEmbedding1D)
    axis = gpc.axis(PM.PARALLEL_1D)
    b, s, h = 2, 8, 16
    block = slice(rank * s // 2, (rank + 1) * s // 2)
    torch.manual_seed(1)
    x = torch.randn(b, s, h)
    out = {}
    for name, width in (('column-rank-major', 8), ('column-batch-first', 64)):
        torch.manual_seed(2)
        layer = ColumnLinear1D(h, width)
        full_w = torch.randn(width, h)   # the serial weight; rank r holds rows r*w/2..
        with torch.no_grad():
            layer.weight.copy_(full_w.chunk(2)[rank])
        local = x[:, block].clone().requires_grad_()
        with comm_profile() as stats:
            y = layer(local)
            (y * torch.arange(1.0, y.numel() + 1).view_as(y) / y.numel()).sum().backward()
        out[name] = dict(y=y.detach(), x_grad=local.grad, w_grad=layer.weight.grad,
                         b_grad=layer.bias.grad, full_w=full_w, bias=layer.bias.detach(),
                         bytes=stats.bytes(axis.mode))
    torch.manual_seed(3)
    row = RowLinear1D(h, 12, input_is_parallel=True)
    full_w = torch.randn(12, h)
    with torch.no_grad():
        row.weight.copy_(full_w.chunk(2, dim=1)[rank])
    local = x[..., rank * h // 2:(rank + 1) * h // 2].clone().requires_grad_()
    y = row(local)
    (y * torch.arange(1.0, y.numel() + 1).view_as(y)).sum().backward()
    out['row'] = dict(y=y.detach(), x_grad=local.grad, w_grad=row.weight.grad,
                      b_grad=row.bias.grad, full_w=full_w, bias=row.bias.detach())
    torch.manual_seed(4)
    emb = VocabParallelEmbedding1D(10, h)
    table = torch.randn(10, h)
    with torch.no_grad():
        emb.weight.copy_(table.chunk(2)[rank])
    ids = torch.randint(0, 10, (b, s), generator=torch.Generator().manual_seed(5))
    y = emb(ids)
    (y * torch.arange(1.0, y.numel() + 1).view_as(y)).sum().backward()
    out['embedding'] = dict(y=y.detach(), w_grad=emb.weight.grad, table=table, ids=ids)
    return x, out


def test_layers_equal_serial_on_the_full_sequence():
    results = run_distributed(_layers_run, 2, SP2)
    b, s, h = 2, 8, 16
    for rank, (x, out) in enumerate(results):
        block = slice(rank * s // 2, (rank + 1) * s // 2)
        for name, width in (('column-rank-major', 8), ('column-batch-first', 64)):
            r = out[name]
            w = r['full_w'].clone().requires_grad_()
            bias = torch.cat([q[name]['bias'] for _, q in results]).requires_grad_()
            xs = x.clone().requires_grad_()
            y = F.linear(xs, w, bias)
            local = b * s * width // 2   # each rank's loss: its own columns, fixed weights
            coef = (torch.arange(1.0, local + 1) / local).view(b, s, width // 2)
            (y * torch.cat([coef, coef], dim=-1)).sum().backward()
            mine = slice(rank * width // 2, (rank + 1) * width // 2)
            assert max_rel_diff(r['y'], y[..., mine].detach()) <= TOL, name
            assert max_rel_diff(r['x_grad'], xs.grad[:, block]) <= TOL, name
            assert max_rel_diff(r['w_grad'], w.grad[mine]) <= TOL, name
            assert max_rel_diff(r['b_grad'], bias.grad[mine]) <= TOL, name
            # all_gather of x forward and backward, reduce_scatter of dx: 3 x b*s*h*4 bytes
            assert r['bytes'] == 3 * b * s * h * 4, name
        row = out['row']
        y = F.linear(x, row['full_w'], row['bias'])
        cols = slice(rank * h // 2, (rank + 1) * h // 2)
        assert max_rel_diff(row['y'], y[:, block].detach()) <= TOL
        # every rank's loss reads its own block: the gradients of x and W sum both blocks
        full_x_grad = sum(_row_grads(results, q)[0] for q in range(2))
        assert max_rel_diff(row['x_grad'], full_x_grad[..., cols]) <= TOL
        w_grad = sum(_row_grads(results, q)[1] for q in range(2))
        assert max_rel_diff(row['w_grad'], w_grad[:, cols]) <= TOL
        assert max_rel_diff(row['b_grad'], sum(_row_grads(results, q)[2] for q in range(2))) \
            <= TOL
        emb = out['embedding']
        table = emb['table'].clone().requires_grad_()
        y = F.embedding(emb['ids'], table)
        assert torch.equal(emb['y'], y[:, block].detach())
        table_grad = sum(_embedding_grad(results, q) for q in range(2))
        assert max_rel_diff(emb['w_grad'], table_grad.chunk(2)[rank]) <= TOL


def _row_grads(results, rank):
    """The serial gradients (x, W, b) of rank ``rank``'s row-linear loss."""
    x, out = results[rank]
    row = out['row']
    s = x.shape[1]
    w = row['full_w'].clone().requires_grad_()
    bias = row['bias'].clone().requires_grad_()
    xs = x.clone().requires_grad_()
    y = F.linear(xs, w, bias)[:, rank * s // 2:(rank + 1) * s // 2]
    (y * torch.arange(1.0, y.numel() + 1).view_as(y)).sum().backward()
    return xs.grad, w.grad, bias.grad


def _embedding_grad(results, rank):
    _, out = results[rank]
    emb = out['embedding']
    s = emb['ids'].shape[1]
    table = emb['table'].clone().requires_grad_()
    y = F.embedding(emb['ids'], table)[:, rank * s // 2:(rank + 1) * s // 2]
    (y * torch.arange(1.0, y.numel() + 1).view_as(y)).sum().backward()
    return table.grad
