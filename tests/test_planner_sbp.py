"""The AutoDDL-style engine on a whole transformer block (auto/sbp.py, auto/sbp_block.py;
docs/planner_autoddl.md):

* the per-axis collectives and their backward duals cost the same, and a conversion's
  backward costs what its forward does on every state pair (elements and alpha-beta time);
* the kinds' backward states (dX = dual(X), dW) hold on real tensors cut into pieces;
* coordinate descent and the exact DP equal a true exhaustive enumeration on 4 devices,
  and coordinate descent equals the DP on 8 devices;
* Megatron's layout is 4 all_reduces of the block input per step (formulas.block_bytes),
  pure data parallelism only the weight all_reduce, and on one axis the optimum takes the
  cheaper of the two per sub-layer;
* AutoDDL's 64-device example for the whole block, in elements and in time.
"""
import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from colossal_lite import formulas
from colossal_lite.auto import sbp
from colossal_lite.auto import sbp_block as sb

ALL_STATES = ('S0', 'S1', 'B', 'P')
FWD_DST = ('S0', 'S1', 'B')


def _ring_all_reduce(p, n, alpha, beta):
    """REFERENCE.md's ring all_reduce of n bytes: 2(p-1) alpha + 2(p-1)/p n beta."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


# ---------------------------------------------------------------------------- conversions
def test_collectives_and_their_backward_duals():
    links = sbp.Links(((1e-5, 1e-9),), elem_bytes=2)
    cases = [  # forward src, dst, elements; its backward goes dual(dst) -> dual(src)
        ('S0', 'B', 48),    # all_gather of a 16-element shard over 4 / reduce_scatter
        ('P', 'S1', 48),    # reduce_scatter of 64 / all_gather
        ('P', 'B', 96),     # all_reduce / all_reduce
        ('S0', 'S1', 12),   # all_to_all / all_to_all
        ('B', 'S0', 0),     # slice / zero-pad
    ]
    for src, dst, elems in cases:
        fwd = sbp.transfer(64, (4,), (src,), (dst,))
        bwd = sbp.transfer_backward(64, (4,), (src,), (dst,))
        assert fwd == bwd == elems, (src, dst)
        steps = {48: 3, 96: 6, 12: 3, 0: 0}[elems]
        expect = steps * 1e-5 + elems * 2 * 1e-9
        assert sbp.transfer(64, (4,), (src,), (dst,), links) == pytest.approx(expect)
        assert sbp.transfer_backward(64, (4,), (src,), (dst,), links) == pytest.approx(expect)
    assert sbp.dual(('S0', 'S1', 'B', 'P')) == ('S0', 'S1', 'P', 'B')
    # time of an all_reduce is the ring formula
    assert sbp.transfer(64, (4,), ('P',), ('B',), links) == pytest.approx(
        _ring_all_reduce(4, 64 * 2, 1e-5, 1e-9))


def test_backward_conversion_costs_equal_forward_on_every_state_pair():
    mesh = (2, 4, 2)
    links = sbp.Links(((3e-5, 4e-10), (2e-6, 1e-10), (7e-6, 3e-11)))
    for src in itertools.product(ALL_STATES, repeat=3):
        for dst in itertools.product(FWD_DST, repeat=3):
            fwd = sbp.transfer(1024, mesh, src, dst)
            assert sbp.transfer_backward(1024, mesh, src, dst) == pytest.approx(fwd)
            assert sbp.transfer(1024, mesh, src, dst) == pytest.approx(
                sbp.convert(1024, mesh, src, dst))          # the best order, found two ways
            assert sbp.transfer_backward(1024, mesh, src, dst, links) == pytest.approx(
                sbp.transfer(1024, mesh, src, dst, links))


def _pieces(t, state, p, gen):
    """The p local tensors of ``t`` in ``state`` on one axis."""
    if state == 'S0':
        return list(t.chunk(p, 0))
    if state == 'S1':
        return list(t.chunk(p, 1))
    if state == 'B':
        return [t.clone() for _ in range(p)]
    parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(p - 1)]
    return parts + [t - sum(parts)]


def _whole(pieces, state):
    """The logical tensor the local ``pieces`` hold in ``state``."""
    if state == 'S0':
        return torch.cat(pieces, 0)
    if state == 'S1':
        return torch.cat(pieces, 1)
    if state == 'B':
        for piece in pieces[1:]:
            assert torch.allclose(piece, pieces[0])
        return pieces[0]
    return sum(pieces)


@pytest.mark.parametrize('p', [2, 3])
def test_matmul_backward_states_on_real_tensors(p):
    gen = torch.Generator().manual_seed(p)
    x, w = (torch.randn(6, 12, generator=gen, dtype=torch.float64),
            torch.randn(12, 6, generator=gen, dtype=torch.float64))
    dy = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    for kind in sbp.KINDS:
        xs, ws = _pieces(x, sbp.X_STATE[kind], p, gen), _pieces(w, sbp.W_STATE[kind], p, gen)
        ys = [a @ b for a, b in zip(xs, ws)]
        assert torch.allclose(_whole(ys, sbp.Y_STATE[kind]), x @ w)
        dys = _pieces(dy, sbp.DUAL[sbp.Y_STATE[kind]], p, gen)
        dxs = [g @ b.T for g, b in zip(dys, ws)]
        dws = [a.T @ g for a, g in zip(xs, dys)]
        assert torch.allclose(_whole(dxs, sbp.DUAL[sbp.X_STATE[kind]]), dy @ w.T), kind
        assert torch.allclose(_whole(dws, sbp.DW_STATE[kind]), x.T @ dy), kind


def test_weight_gradient_is_one_all_reduce_over_the_replicated_axes():
    mesh, n = (2, 4, 2), 4096
    local = n / 4                                            # split 4 ways by the N axis
    assert sbp.weight_grad(n, mesh, ('M', 'N', 'M')) == pytest.approx(2 * 3 / 4 * local)
    assert sbp.weight_grad(n, mesh, ('N', 'K', 'N')) == 0
    links = sbp.Links(((1e-5, 1e-9),), elem_bytes=4)
    assert sbp.weight_grad(n, (8,), ('M',), links) == pytest.approx(
        _ring_all_reduce(8, n * 4, 1e-5, 1e-9))


# ---------------------------------------------------------------------------- the search
def _random_plan(rng, mesh):
    return {v: rng.choice(sb.choices(mesh, v, canonical=False)) for v in sb.VARS}


def test_dp_and_coordinate_descent_equal_true_exhaustive_on_4_devices():
    rng = random.Random(5)
    cases = [(sb.BlockShape(64, 256), None, False, 1),
             (sb.BlockShape(1024, 64, 2), None, True, 2),
             (sb.BlockShape(256, 512), sbp.Links(((5e-5, 1e-10), (5e-6, 1e-11))), True, 1),
             (sb.BlockShape(16, 1024, 4), sbp.Links(((1e-4, 1e-9), (1e-6, 1e-10))), True, 2)]
    for block, links, backward, split in cases:
        for mesh in sb.meshes(4, 2):
            ex, ex_plan = sb.exhaustive(mesh, block, links, backward, split)
            dp, dp_plan = sb.exact_dp(mesh, block, links, backward, split)
            cd, cd_plan = sb.coordinate_descent(mesh, block, links, backward, split)
            assert dp == pytest.approx(ex) and cd == pytest.approx(ex), (mesh, block)
            for plan in (ex_plan, dp_plan, cd_plan):
                assert sb.block_cost(mesh, plan, block, links, backward, split) == \
                    pytest.approx(ex)
            for _ in range(40):
                plan = _random_plan(rng, mesh)
                assert sb.block_cost(mesh, plan, block, links, backward, split) >= ex * (1 - 1e-12)


def test_coordinate_descent_equals_exact_dp_on_8_devices():
    rng = random.Random(11)
    for i in range(6):
        block = sb.BlockShape(2 ** rng.randint(5, 13), 2 ** rng.randint(5, 10), rng.choice([1, 4]))
        split, backward = rng.choice([1, 2, 4]), bool(i % 2)
        for mesh in sb.meshes(8, 2) + [(2, 2, 2)]:
            links = None if i < 3 else sbp.Links(tuple(
                (rng.choice([1e-6, 1e-5, 1e-4]), rng.choice([1e-11, 1e-10, 1e-9])) for _ in mesh))
            dp, _ = sb.exact_dp(mesh, block, links, backward, split)
            cd, plan = sb.coordinate_descent(mesh, block, links, backward, split)
            assert cd == pytest.approx(dp), (mesh, block, links, backward, split)
            assert sb.fits(mesh, plan, split)


# ---------------------------------------------------------------------------- cross-checks
@pytest.mark.parametrize('t', [2, 4, 8])
def test_megatron_block_is_four_all_reduces_per_step(t):
    b, s, h = 4, 32, 64
    block, plan, mesh = sb.BlockShape(b * s, h), sb.megatron_plan(2), (1, t)
    traffic = sb.block_traffic(mesh, plan, block)
    all_reduce = 2 * (t - 1) / t * b * s * h                   # elements received by a ring
    assert traffic == {'forward': 2 * all_reduce, 'backward': 2 * all_reduce, 'weight_grad': 0}
    # formulas.block_bytes counts buffer bytes (n per all_reduce): the ring receives 2(t-1)/t n
    buffer_elems = formulas.block_bytes('1d', t, b, s, h) / 4
    assert sum(traffic.values()) == pytest.approx(2 * (t - 1) / t * buffer_elems)
    links = sbp.Links(((1e-3, 1e-3), (2e-5, 1e-10)), elem_bytes=4)
    assert sb.block_cost(mesh, plan, block, links) == pytest.approx(
        4 * _ring_all_reduce(t, b * s * h * 4, 2e-5, 1e-10))
    # with a data axis of 4: the 1D-local weights (formulas.params) all_reduced over it
    lin = formulas.params('1d', SimpleNamespace(tensor=t))['linear']
    local = (lin(h, 3 * h, False) + lin(h, h, False, 'exit') + lin(h, 4 * h, False)
             + lin(4 * h, h, False, 'exit'))
    dp_sync = formulas.gradient_sync_bytes(0, local) / 4
    assert sb.block_traffic((4, t), plan, block)['weight_grad'] == pytest.approx(
        2 * 3 / 4 * dp_sync)


@pytest.mark.parametrize('p', [2, 8])
def test_data_parallel_block_and_the_one_axis_optimum(p):
    h = 256
    block = sb.BlockShape(4 * h, h)
    traffic = sb.block_traffic((p,), sb.data_parallel_plan(1), block)
    weights = 12 * h * h                                    # qkv, out, fc1, fc2; no biases/LN
    assert traffic['forward'] == traffic['backward'] == 0
    assert traffic['weight_grad'] == pytest.approx(
        2 * (p - 1) / p * formulas.gradient_sync_bytes(0, weights) / 4)
    # one axis: each sub-layer takes the cheaper of data parallel (its weights all_reduced)
    # and Megatron (2 all_reduces of t h, forward + backward); attention flips at t = 2h,
    # the MLP at t = 4h
    for tokens in (h // 4, h, 3 * h, 16 * h):
        ring = 2 * (p - 1) / p
        expect = ring * (min(4 * h * h, 2 * tokens * h) + min(8 * h * h, 2 * tokens * h))
        cost, plan = sb.exact_dp((p,), sb.BlockShape(tokens, h))
        assert cost == pytest.approx(expect), tokens
    assert plan == sb.data_parallel_plan(1)


def test_autoddl_block_example_in_elements():
    """64 devices, h = 8192, 2^20 tokens, every weight split 16 ways: Megatron 4 x 16
    moves 7.5 * 2^30 elements forward and as much backward; the best 3-axis plan 5 * 2^30."""
    block, g = sb.BlockShape(2 ** 20, 2 ** 13), 2 ** 30
    megatron = sb.block_traffic((4, 16), sb.megatron_plan(2), block)
    wg = 2 * 3 / 4 * 12 * 2 ** 26 / 16
    assert megatron == {'forward': 7.5 * g, 'backward': 7.5 * g, 'weight_grad': wg}
    fwd, mesh, plan = sb.search(64, block, axes=3, min_split=16, backward=False)
    assert fwd == 5 * g and sb.block_traffic(mesh, plan, block)['forward'] == fwd
    total, mesh, plan = sb.search(64, block, axes=3, min_split=16)
    assert total == pytest.approx(10 * g + wg)
    assert min(sbp.weight_split(mesh, plan[m]) for m in sb.MATMULS) >= 16


def test_node_links_and_the_time_example_on_64_devices():
    """Outer axis across nodes of 16, 10x slower than NVLink inside: the time-minimizing
    3-axis plan keeps every activation inside a node and beats Megatron 4 x 16."""
    intra, inter = (5e-6, 1 / 100e9), (5e-5, 1 / 10e9)
    assert sb.node_links((4, 16), 16, intra, inter).axes == (inter, intra)
    assert sb.node_links((2, 2, 4, 4), 16, intra, inter).axes == (inter, inter, intra, intra)

    def links(mesh):
        return sb.node_links(mesh, 16, intra, inter)
    block = sb.BlockShape(2 ** 20, 2 ** 13)
    megatron = sb.block_cost((4, 16), sb.megatron_plan(2), block, links((4, 16)), True, 16)
    shard = 2 ** 33 / 64 * 2                                  # bytes of the split stream
    ag = 15 * intra[0] + 15 * shard * intra[1]                # all_gather = reduce_scatter
    w_bytes = 12 * 2 ** 26 / 16 * 2
    wg = 4 * 6 * inter[0] + 2 * 3 / 4 * w_bytes * inter[1]   # one all_reduce per weight
    assert megatron == pytest.approx(8 * ag + wg)
    cost, mesh, plan = sb.search(64, block, axes=3, links=links, min_split=16)
    assert cost == pytest.approx(sb.block_cost(mesh, plan, block, links(mesh), True, 16))
    assert cost <= 0.7 * megatron                             # 0.231 s vs 0.339 s
    assert mesh[0] == 4 and all(plan[m][0] == 'M' for m in sb.MATMULS)
