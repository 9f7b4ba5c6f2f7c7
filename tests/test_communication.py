"""Collectives, point-to-point and autograd pairs on 4 gloo ranks, with exact byte counts."""
import torch

import colossal_lite.communication as comm
from colossal_lite.context import ParallelMode as PM
from colossal_lite.testing import run_distributed

WORLD = 4
F32 = 4


def _values(rank):
    return torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank


def _collectives(rank):
    out = {}
    x = _values(rank)
    with comm.comm_profile() as stats:
        out['all_reduce'] = comm.all_reduce(x, PM.GLOBAL)
        out['all_gather0'] = comm.all_gather(x, PM.GLOBAL, dim=0)
        out['all_gather1'] = comm.all_gather(x, PM.GLOBAL, dim=1)
        out['reduce_scatter0'] = comm.reduce_scatter(torch.arange(8.).view(4, 2) * (rank + 1), PM.GLOBAL, dim=0)
        out['reduce_scatter1'] = comm.reduce_scatter(torch.arange(8.).view(2, 4) * (rank + 1), PM.GLOBAL, dim=1)
        out['broadcast'] = comm.broadcast(x, PM.GLOBAL, src=2)
        out['reduce'] = comm.reduce(x, PM.GLOBAL, dst=1)
        out['all_to_all'] = comm.all_to_all(torch.full((4, 2), float(rank)), PM.GLOBAL, 0, 1)
        pending = comm.all_reduce(x, PM.GLOBAL, async_op=True)
        gathered = comm.all_gather(x, PM.GLOBAL, dim=1, async_op=True)
        out['async'] = (pending.wait(), gathered.wait())
        out['ring'] = comm.ring_exchange(torch.tensor([float(rank)]), PM.GLOBAL)
        if rank == 0:
            comm.send(torch.tensor([7.0, 8.0]), PM.GLOBAL, dst=3)
        if rank == 3:
            out['recv'] = comm.recv(torch.empty(2), PM.GLOBAL, src=0)
    out['input_untouched'] = x
    out['counts'] = {(m.name, op): (stats.calls(m, op), stats.bytes(m, op), stats.wire_bytes(m, op))
                     for m, op in stats.keys()}
    return out


def test_collectives_values_and_exact_counts():
    results = run_distributed(_collectives, WORLD, None, timeout=300)
    total = sum(_values(r) for r in range(WORLD))
    for rank, out in enumerate(results):
        assert torch.equal(out['all_reduce'], total)
        assert torch.equal(out['all_gather0'], torch.cat([_values(r) for r in range(WORLD)], 0))
        assert torch.equal(out['all_gather1'], torch.cat([_values(r) for r in range(WORLD)], 1))
        assert torch.equal(out['reduce_scatter0'], 10 * torch.arange(8.).view(4, 2)[rank:rank + 1])
        assert torch.equal(out['reduce_scatter1'], 10 * torch.arange(8.).view(2, 4)[:, rank:rank + 1])
        assert torch.equal(out['broadcast'], _values(2))
        assert torch.equal(out['all_to_all'], torch.tensor([[0., 0., 1., 1., 2., 2., 3., 3.]]))
        assert torch.equal(out['async'][0], total)
        assert torch.equal(out['async'][1], out['all_gather1'])
        assert out['ring'].item() == (rank - 1) % WORLD
        assert torch.equal(out['input_untouched'], _values(rank))
        counts = out['counts']
        n = 6 * F32
        assert counts[('GLOBAL', 'all_reduce')] == (2, 2 * n, 2 * 2 * 3 / 4 * n)
        assert counts[('GLOBAL', 'all_gather')] == (3, 3 * 4 * n, 3 * 3 / 4 * 4 * n)
        assert counts[('GLOBAL', 'reduce_scatter')] == (2, 2 * 8 * F32, 2 * 3 / 4 * 8 * F32)
        assert counts[('GLOBAL', 'broadcast')] == (1, n, 3 / 4 * n)
        assert counts[('GLOBAL', 'reduce')] == (1, n, 3 / 4 * n)
        assert counts[('GLOBAL', 'all_to_all')] == (1, 8 * F32, 3 / 4 * 8 * F32)
        sends = 1 + (rank == 0)
        recvs = 1 + (rank == 3)
        assert counts[('GLOBAL', 'send')][0] == sends
        assert counts[('GLOBAL', 'recv')][0] == recvs
    assert torch.equal(results[1]['reduce'], total)
    assert torch.equal(results[3]['recv'], torch.tensor([7.0, 8.0]))


def _pairwise(rank):
    """all_gather / reduce_scatter as one all_to_all (``pairwise``) against the backend's."""
    x = torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(rank))
    out = {'prefers': comm.prefers_pairwise(PM.GLOBAL)}
    for dim in (0, 1):
        with comm.comm_profile() as native_stats:
            native = (comm.all_gather(x, PM.GLOBAL, dim), comm.reduce_scatter(x, PM.GLOBAL, dim))
        with comm.comm_profile() as pair_stats:
            gathered = comm.all_gather(x, PM.GLOBAL, dim, async_op=True, pairwise=True).wait()
            summed = comm.reduce_scatter(x, PM.GLOBAL, dim, async_op=True, pairwise=True).wait()
        out[dim] = (native, (gathered, summed),
                    [(s.calls(m, op), s.bytes(m, op), s.wire_bytes(m, op))
                     for s in (native_stats, pair_stats) for m, op in sorted(s.keys())])
    try:
        comm.reduce_scatter(x, PM.GLOBAL, 0, op=torch.distributed.ReduceOp.MAX, pairwise=True)
    except ValueError as err:
        out['max_error'] = str(err)
    return out


def test_pairwise_all_gather_and_reduce_scatter_equal_the_backend_and_count_the_same():
    results = run_distributed(_pairwise, WORLD, None, timeout=300)
    for out in results:
        assert out['prefers'] is True          # gloo
        for dim in (0, 1):
            (ag, rs), (ag_pair, rs_pair), counts = out[dim]
            assert torch.equal(ag_pair, ag)
            torch.testing.assert_close(rs_pair, rs, rtol=1e-6, atol=1e-6)
            assert rs_pair.shape == rs.shape and rs_pair.is_contiguous()
            assert counts[:2] == counts[2:]    # same calls, bytes and wire bytes recorded
        assert 'sums' in out['max_error']


def _autograd_pairs(rank):
    axis = comm.resolve(PM.GLOBAL)
    grads = {}
    weight = torch.arange(1., 9.).view(2, 4)  # fixed upstream gradient pattern
    for name in ('copy_to', 'reduce_from', 'split_to', 'gather_from', 'all_gather_to',
                 'reduce_scatter_to'):
        x = (_values(rank)[:, :2].repeat(1, 4) if name != 'split_to' else torch.ones(2, 8)).requires_grad_()
        fn = getattr(comm, name)
        y = fn(x, axis) if name in ('copy_to', 'reduce_from') else fn(x, axis, 1)
        upstream = weight.repeat(1, y.shape[1] // 4) if y.shape[1] >= 4 else weight[:, :y.shape[1]]
        (y * upstream * (rank + 1)).sum().backward()
        grads[name] = (y.detach(), x.grad)
    return grads


def test_autograd_pairs_are_conjugate():
    results = run_distributed(_autograd_pairs, WORLD, None, timeout=300)
    w = torch.arange(1., 9.).view(2, 4)
    sum_scale = sum(r + 1 for r in range(WORLD))
    xs = [_values(r)[:, :2].repeat(1, 4) for r in range(WORLD)]
    for rank, g in enumerate(results):
        up8 = w.repeat(1, 2)
        # copy_to: identity forward, all_reduce backward
        assert torch.equal(g['copy_to'][0], xs[rank])
        assert torch.equal(g['copy_to'][1], up8 * sum_scale)
        # reduce_from: all_reduce forward, identity backward
        assert torch.equal(g['reduce_from'][0], sum(xs))
        assert torch.equal(g['reduce_from'][1], up8 * (rank + 1))
        # split_to: own chunk of dim 1 forward, all_gather backward
        assert g['split_to'][0].shape == (2, 2)
        full_grad = torch.cat([w[:, :2] * (r + 1) for r in range(WORLD)], 1)
        assert torch.equal(g['split_to'][1], full_grad)
        # gather_from: all_gather forward, own chunk backward
        assert torch.equal(g['gather_from'][0], torch.cat(xs, 1))
        up32 = w.repeat(1, 8) * (rank + 1)
        assert torch.equal(g['gather_from'][1], up32[:, 8 * rank:8 * rank + 8])
        # all_gather_to: all_gather forward, reduce_scatter backward
        assert torch.equal(g['all_gather_to'][0], torch.cat(xs, 1))
        assert torch.equal(g['all_gather_to'][1], w.repeat(1, 8)[:, 8 * rank:8 * rank + 8] * sum_scale)
        # reduce_scatter_to: reduce_scatter forward, all_gather backward
        assert torch.equal(g['reduce_scatter_to'][0], sum(xs)[:, 2 * rank:2 * rank + 2])
        assert torch.equal(g['reduce_scatter_to'][1],
                           torch.cat([w[:, :2] * (r + 1) for r in range(WORLD)], 1))


def _single_rank_groups_are_free(rank):
    x = torch.ones(3)
    with comm.comm_profile() as stats:
        y = comm.all_reduce(x, PM.TENSOR)
        z = comm.all_gather(x, PM.TENSOR)
    return stats.calls(), torch.equal(y, x) and torch.equal(z, x)


def test_single_rank_groups_move_nothing():
    for calls, same in run_distributed(_single_rank_groups_are_free, 2, None, timeout=300):
        assert calls == 0 and same
