"""``colossal_lite.nn.MoE`` equals a naive per-token reference, serially and with experts
spread over E = 2 and E = 4 ranks.

Serial: outputs, every parameter's gradient (the aux and z losses reaching the gradient
through the layer, the training loss a mean over tokens) and the loss values equal a
per-token Python loop for softmax and sigmoid routers, top-1 and top-2, with and without
shared experts (gated), dropless and with capacity drops, with a balancing bias.
Expert parallel: each rank feeds its rows of the batch; its outputs equal the serial rows,
expert gradients summed over EXPERT_DATA (and divided by the data size, as the engine's sync
does) and dense gradients averaged over DATA equal the serial ones, by hand and after the
engine's ``allreduce_gradients``; the all_to_all bytes
equal ``8 * experts + 2 * 4 * h * (rows sent to + received from other ranks)`` for a forward
and backward; an expert given no token has a zero (not None) gradient on every rank; bias
balancing evens out a skewed router.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode as PM, ProcessGroupAxis, global_context as gpc
from colossal_lite.engine import allreduce_gradients
from colossal_lite.nn import MoE
from colossal_lite.nn.moe import capacity, update_balance_biases
from colossal_lite.testing import max_rel_diff, run_distributed

H, F_, X = 8, 12, 8          # hidden, expert width, experts
B, S = 4, 6                  # batch rows, sequence
SEED = 7
TOL = 1e-5
TIMEOUT = 240


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    """Tiny ops: a second OpenMP thread only adds contention on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- reference
def _swiglu(x, gate, up, down):
    return (F.silu(x @ gate) * (x @ up)) @ down


def reference(moe: MoE, params: dict, x: torch.Tensor):
    """The layer, token by token in Python, on ``params`` (full tensors by name). Returns
    ``out``, the aux and z losses (coef included), the routing ``[(token, expert, kept)]``
    and the per-expert counts before drops."""
    router, k, score = moe.router, moe.top_k, moe.router.score
    bias = router.balance.bias if router.balance is not None else torch.zeros(X)
    tokens = x.reshape(-1, H)
    n, seq = tokens.shape[0], x.shape[-2]
    cap = (capacity(moe.capacity_factor, seq, k, X) if moe.capacity_factor is not None
           else math.inf)
    outs, probs, lse, routing = [], [], [], []
    counts = [0] * X
    used = {}                                  # (row, expert) -> slots seen so far
    for t in range(n):
        xt = tokens[t]
        logits = params['router.weight'] @ xt
        lse.append(torch.logsumexp(logits, 0))
        if score == 'softmax':
            s = torch.softmax(logits, 0)
            probs.append(s)
        else:
            s = torch.sigmoid(logits)
            probs.append(s / s.sum())
        biased = (s.detach() + bias).tolist()
        chosen = sorted(range(X), key=lambda e: -biased[e])[:k]
        w = torch.stack([s[e] for e in chosen])
        if moe.router.renormalize:
            w = w / (w.sum() + (1e-20 if score == 'sigmoid' else 0.0))
        out = torch.zeros(H)
        for j, e in enumerate(chosen):
            counts[e] += 1
            seen = used.get((t // seq, e), 0)
            used[(t // seq, e)] = seen + 1
            kept = seen < cap
            routing.append((t, e, kept))
            if kept:
                out = out + w[j] * _swiglu(xt, params['experts.gate'][e],
                                           params['experts.up'][e], params['experts.down'][e])
        if moe.shared_expert is not None:
            width = params['shared_expert.gate_proj.weight'].shape[0] // SHARED
            shared = torch.zeros(H)
            for i in range(SHARED):            # n experts of width f_s, summed
                part = slice(i * width, (i + 1) * width)
                shared = shared + _swiglu(xt, params['shared_expert.gate_proj.weight'][part].t(),
                                          params['shared_expert.up_proj.weight'][part].t(),
                                          params['shared_expert.down_proj.weight'][:, part].t())
            if moe.shared_expert_gate is not None:
                shared = torch.sigmoid(params['shared_expert_gate.weight'][0] @ xt) * shared
            out = out + shared
        outs.append(out)
    f = torch.tensor(counts, dtype=torch.float32) / (n * k)
    mean_p = torch.stack(probs).mean(0)
    aux = moe.aux_loss_coef * X * (f * mean_p).sum()
    z = moe.z_loss_coef * torch.stack(lse).square().mean()
    return torch.stack(outs).view(x.shape), aux, z, routing, counts


def token_loss(out, weight):
    """A training loss that is a mean over tokens."""
    return (out * weight).sum(-1).mean()


SHARED = 2
CASES = {
    'softmax-top2': dict(top_k=2),
    'softmax-top1': dict(top_k=1, renormalize=False),
    'softmax-top2-no-renorm-shared-gated': dict(top_k=2, renormalize=False,
                                                shared_experts=SHARED, shared_ffn_hidden=6,
                                                shared_gate=True),
    'sigmoid-top2-shared': dict(top_k=2, score='sigmoid', shared_experts=SHARED,
                                shared_ffn_hidden=6),
    'sigmoid-top1': dict(top_k=1, score='sigmoid'),
    'softmax-top2-capacity': dict(top_k=2, capacity_factor=0.5),
    'softmax-top1-capacity-shared': dict(top_k=1, capacity_factor=0.7, renormalize=False,
                                         shared_experts=SHARED, shared_ffn_hidden=6,
                                         shared_gate=True),
    'sigmoid-top2-capacity-bias': dict(top_k=2, score='sigmoid', capacity_factor=1.0,
                                       bias_update_rate=0.1),
}
LOSSES = dict(aux_loss_coef=0.05, z_loss_coef=0.01)


def build(case: str, **kw) -> MoE:
    torch.manual_seed(SEED)
    moe = MoE(H, F_, X, **{**LOSSES, **CASES[case], **kw})
    if moe.router.balance is not None:
        moe.router.balance.bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, 0.0, -0.1, 0.2, 0.0]))
    return moe


def data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def serial_run(case: str):
    """Output, gradients by name, losses and routing of the serial layer and of the
    reference on the same weights."""
    moe = build(case)
    x, w = data()
    x.requires_grad_()
    out = moe(x)
    token_loss(out, w).backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters()}
    ref_x = x.detach().clone().requires_grad_()
    ref_out, aux, z, routing, counts = reference(moe, params, ref_x)
    (token_loss(ref_out, w) + aux + z).backward()
    return dict(moe=moe, out=out.detach(), ref_out=ref_out.detach(), aux=aux.detach(),
                z=z.detach(), routing=routing, counts=counts, x_grad=x.grad,
                ref_x_grad=ref_x.grad, grads={n: p.grad for n, p in moe.named_parameters()},
                ref_grads={n: p.grad for n, p in params.items()})


@pytest.fixture(scope='module', params=list(CASES))
def serial(request):
    return request.param, serial_run(request.param)


def test_serial_layer_equals_per_token_reference(serial):
    """Outputs, the input's and every parameter's gradient (aux and z losses included) equal
    the loop."""
    case, r = serial
    assert max_rel_diff(r['out'], r['ref_out']) <= TOL, case
    assert max_rel_diff(r['x_grad'], r['ref_x_grad']) <= TOL, case
    assert set(r['grads']) == set(r['ref_grads'])
    for name, grad in r['grads'].items():
        assert grad is not None, (case, name)
        assert max_rel_diff(grad, r['ref_grads'][name]) <= TOL, (case, name)


def test_serial_losses_and_counts_equal_reference(serial):
    case, r = serial
    moe = r['moe']
    assert abs(moe.last_aux_loss.item() - r['aux'].item()) <= 1e-6, case
    assert abs(moe.last_z_loss.item() - r['z'].item()) <= 1e-6, case
    assert r['aux'].item() > 0 and r['z'].item() > 0
    assert moe.last_tokens_per_expert.dtype == torch.int64
    assert moe.last_tokens_per_expert.tolist() == r['counts'], case


def test_capacity_drops_slots_and_dropless_keeps_all(serial):
    """The capacity cases drop slots (so the rule is exercised), dropless ones none."""
    case, r = serial
    dropped = sum(not kept for _, _, kept in r['routing'])
    if CASES[case].get('capacity_factor') is None:
        assert dropped == 0
    else:
        assert dropped > 0, case


def test_aux_gradient_reaches_the_router_only_through_the_losses():
    """Without the losses the router gradient differs: the check above can fail."""
    with_losses, without = build('softmax-top2'), build('softmax-top2', aux_loss_coef=0.0,
                                                        z_loss_coef=0.0)
    x, w = data()
    for moe in (with_losses, without):
        token_loss(moe(x), w).backward()
    assert max_rel_diff(with_losses.router.weight.grad, without.router.weight.grad) > 1e-3
    assert torch.equal(with_losses.experts.gate.grad, without.experts.gate.grad)


def test_aux_loss_scale_scales_only_the_losses_gradient():
    """``aux_loss_scale`` = a (AMP loss scale / micro-batches) with a loss multiplied by a:
    every gradient is a times the unscaled one."""
    x, w = data()
    plain, scaled = build('softmax-top2'), build('softmax-top2')
    token_loss(plain(x), w).backward()
    scaled.aux_loss_scale = 8.0
    (8.0 * token_loss(scaled(x), w)).backward()
    for (name, a), b in zip(plain.named_parameters(), scaled.parameters()):
        assert max_rel_diff(b.grad / 8.0, a.grad) <= TOL, name


def test_uniform_routing_gives_aux_equal_to_coef():
    moe = build('softmax-top1')
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(data()[0])
    # all logits 0: P_i = 1/X, every token picks expert 0 (f_0 = 1): aux = coef * X * 1/X
    assert abs(moe.last_aux_loss.item() - LOSSES['aux_loss_coef']) <= 1e-7


def test_eval_mode_skips_losses_and_counts_locally():
    moe = build('softmax-top2').eval()
    out = moe(data()[0])
    assert moe.last_aux_loss.item() == 0.0 and out.shape == (B, S, H)


def test_input_of_any_leading_dims():
    moe = build('softmax-top2')
    x = data()[0]
    assert torch.allclose(moe(x.view(2, 2, S, H)).view(B, S, H), moe(x), atol=1e-6)


# ----------------------------------------------------------------------------- no tokens
def test_expert_without_tokens_has_zero_gradient():
    """Expert 3 never selected (bias -100): its slices of the stacked weights get a zero
    gradient, not None (so data-parallel buckets stay aligned); its router row still learns
    through the aux loss. AdamW then still moves the slice (docs/moe.md)."""
    moe = build('sigmoid-top2-capacity-bias', capacity_factor=None)
    moe.router.balance.bias[3] = -100.0
    x, w = data()
    token_loss(moe(x), w).backward()
    assert moe.last_tokens_per_expert[3].item() == 0
    for p in (moe.experts.gate, moe.experts.up, moe.experts.down):
        assert p.grad is not None
        assert torch.count_nonzero(p.grad[3]) == 0
        assert torch.count_nonzero(p.grad[:3]) > 0 and torch.count_nonzero(p.grad[4:]) > 0
    assert torch.count_nonzero(moe.router.weight.grad[3]) > 0


# ----------------------------------------------------------------------------- balancing
def test_bias_balancing_evens_out_a_skewed_router():
    """A top-1 router skewed to expert 0 (max/mean tokens per expert 3.5 on a fixed batch):
    after 50 bias updates of rate 0.01 the ratio stays <= 1.2."""
    torch.manual_seed(0)
    moe = MoE(H, F_, 4, 1, score='sigmoid', bias_update_rate=0.01)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, H, generator=g) + 0.5
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(4, H, generator=g) * 0.3)
        moe.router.weight[0] += 1.0
    ratios = []
    for _ in range(51):
        moe(x)
        c = moe.last_tokens_per_expert.float()
        ratios.append((c.max() / c.mean()).item())
        moe.update_balance_bias()
    assert ratios[0] > 3.0, ratios[0]
    assert max(ratios[-10:]) <= 1.2, ratios


def test_balance_bias_update_rule_and_helpers():
    moe = build('sigmoid-top2-capacity-bias')
    moe.router.balance.bias.zero_()
    moe(data()[0])
    counts = moe.last_tokens_per_expert.float()
    moe(data()[0])                               # two forwards: counts accumulate
    update_balance_biases(torch.nn.Sequential(moe))
    expected = 0.1 * torch.sign(2 * counts.mean() - 2 * counts)
    assert torch.equal(moe.router.balance.bias, expected)
    before = moe.router.balance.bias.clone()
    moe.update_balance_bias()                    # no forward since: no-op
    assert torch.equal(moe.router.balance.bias, before)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize('kwargs, message', [
    (dict(top_k=9), 'MoE top_k = 9 must be between 1 and experts = 8'),
    (dict(top_k=0), 'MoE top_k = 0 must be between 1 and experts = 8'),
    (dict(top_k=2, capacity_factor=0), 'MoE capacity_factor must be None (dropless) or a '
                                        'number > 0, got 0'),
    (dict(top_k=2, capacity_factor=-1.0), 'got -1.0'),
    (dict(top_k=2, score='relu'), "MoE score must be one of ('softmax', 'sigmoid'), got 'relu'"),
])
def test_bad_arguments_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError) as err:
        MoE(H, F_, X, **kwargs)
    assert message in str(err.value)


def test_experts_not_divisible_by_expert_ranks():
    axis = ProcessGroupAxis(PM.EXPERT, None, (0, 1, 2), 0, 3)
    with pytest.raises(ValueError, match=r'experts = 8 must be divisible by the '
                                         r'expert-parallel size E = 3'):
        MoE(H, F_, X, 2, expert_axis=axis)


# ----------------------------------------------------------------------------- expert parallel
EP_CASES = ['softmax-top2-no-renorm-shared-gated', 'softmax-top2-capacity',
            'sigmoid-top2-capacity-bias']


def _ep_worker(rank, own_group, idle):
    """Every case on this rank's rows. ``own_group``: the EXPERT axis is a group built here
    over all ranks (not the launched one). ``idle``: experts that get no token."""
    torch.set_num_threads(1)
    axis = None
    if own_group:
        world = dist.get_world_size()
        axis = ProcessGroupAxis(PM.EXPERT, dist.new_group(list(range(world))),
                                tuple(range(world)), rank, world)
    data_axis = gpc.axis(PM.DATA)
    results = {}
    for case in EP_CASES:
        moe = build(case, expert_axis=axis)
        if idle:
            if moe.router.balance is None:
                continue
            moe.router.balance.bias[list(idle)] = -100.0
        x, w = data()
        rows = slice(data_axis.rank * B // data_axis.size,
                     (data_axis.rank + 1) * B // data_axis.size)
        x = x[rows].clone().requires_grad_()
        with comm_profile() as stats:
            out = moe(x)
            token_loss(out, w[rows]).backward()
        grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
        synced = None
        if not own_group:   # the engine's sync: expert grads over EXPERT_DATA, dense over DATA
            allreduce_gradients(moe.parameters())
            synced = {n: p.grad for n, p in moe.named_parameters()}
        results[case] = dict(
            out=out.detach(), x_grad=x.grad, grads=grads, synced=synced,
            expert_rank=moe.expert_axis.rank, expert_size=moe.expert_axis.size,
            expert_data=(gpc.axis(PM.EXPERT_DATA).ranks if not own_group else (rank,)),
            data_rank=data_axis.rank, data_size=data_axis.size,
            a2a_bytes=stats.bytes(PM.EXPERT, 'all_to_all'),
            a2a_calls=stats.calls(PM.EXPERT, 'all_to_all'),
            stats_bytes=stats.bytes(PM.DATA, 'all_reduce'),
            tokens=moe.last_tokens_per_expert.clone(), aux=moe.last_aux_loss.clone())
    return results


def _expected_a2a_bytes(routing, data_rank, e_size, rows_per_rank):
    """``8 * X + 2 * 4 * h * (S_off + R_off)``: the counts, then the rows this rank sends to
    other ranks of its EXPERT group (S_off) and receives from them (R_off) forward, the same
    backward; from the reference's routing. Data rank d is EXPERT rank d % E of group d // E."""
    local = X // e_size
    tokens_per_rank = rows_per_rank * S
    sent = received = 0
    for t, e, kept in routing:
        src = t // tokens_per_rank                      # data rank holding the token
        if not kept or src // e_size != data_rank // e_size:
            continue
        src_e, dst_e = src % e_size, e // local          # EXPERT ranks of token and expert
        if src_e == dst_e:
            continue
        sent += src == data_rank
        received += dst_e == data_rank % e_size
    return 8 * X + 2 * 4 * H * (sent + received)


def _check_ep(results, idle=()):
    for case in EP_CASES:
        per_rank = [r[case] for r in results if case in r]
        if not per_rank:
            continue
        ref = _serial_idle(case, idle) if idle else serial_run(case)
        data_size = per_rank[0]['data_size']
        rows = B // data_size
        e_size = per_rank[0]['expert_size']
        local = X // e_size
        dense = {n for n in ref['grads'] if not n.startswith('experts.')}
        for r in per_rank:
            d = r['data_rank']
            assert max_rel_diff(r['out'], ref['out'][d * rows:(d + 1) * rows]) <= TOL, case
            x_grad = ref['x_grad'][d * rows:(d + 1) * rows] * data_size   # local mean loss
            assert max_rel_diff(r['x_grad'], x_grad) <= TOL, case
            assert torch.equal(r['tokens'], torch.tensor(ref['counts'])), case
            assert r['expert_rank'] == d % e_size
            assert r['a2a_bytes'] == _expected_a2a_bytes(ref['routing'], d, e_size, rows), case
            assert r['a2a_calls'] == 5
            assert r['stats_bytes'] == 8 * X
        for name in dense:   # data-parallel average
            mean = sum(r['grads'][name] for r in per_rank) / data_size
            assert max_rel_diff(mean, ref['grads'][name]) <= TOL, (case, name)
        for name in ref['grads'].keys() - dense:
            for r in per_rank:   # summed over EXPERT_DATA, divided by the data size
                group = [q for q in per_rank if q['expert_rank'] == r['expert_rank']]
                assert len(group) == data_size // e_size
                grad = sum(q['grads'][name] for q in group) / data_size
                e = r['expert_rank']
                full = ref['grads'][name][e * local:(e + 1) * local]
                assert max_rel_diff(grad, full) <= TOL, (case, name, e)
        # the engine's sync gives every rank the serial gradient (its experts' rows)
        for r in per_rank:
            if r['synced'] is None:
                continue
            e = r['expert_rank']
            for name, grad in r['synced'].items():
                full = ref['grads'][name]
                full = full[e * local:(e + 1) * local] if name not in dense else full
                assert max_rel_diff(grad, full) <= TOL, ('synced', case, name, e)
        # the aux of the replicas averages to the serial one
        aux = sum(r['aux'] for r in per_rank) / data_size
        assert abs(aux.item() - ref['moe'].last_aux_loss.item()) <= 1e-6, case


def _serial_idle(case, idle):
    moe = build(case)
    moe.router.balance.bias[list(idle)] = -100.0
    x, w = data()
    x.requires_grad_()
    out = moe(x)
    token_loss(out, w).backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters()}
    _, _, _, routing, counts = reference(moe, params, x.detach())
    return dict(moe=moe, out=out.detach(), routing=routing, counts=counts, x_grad=x.grad,
                grads={n: p.grad for n, p in moe.named_parameters()})


@pytest.mark.parametrize('world, parallel, own_group', [
    (2, dict(expert=2), False),           # E = 2 = data
    (4, dict(expert=4), False),           # E = 4 = data
    (4, dict(expert=2), False),           # E = 2, data 4: EXPERT_DATA pairs
    (4, dict(), True),                    # E = 4 over a group built by the test
], ids=['E2', 'E4', 'E2-data4', 'E4-own-group'])
def test_expert_parallel_equals_serial(world, parallel, own_group):
    results = run_distributed(_ep_worker, world, dict(parallel=parallel), own_group, (),
                              timeout=TIMEOUT)
    _check_ep(results)


def test_expert_parallel_rank_without_tokens():
    """E = 4, experts 6 and 7 (rank 3's) never selected: rank 3 receives no row, its
    gradients are zero (not None), everything still equals serial."""
    results = run_distributed(_ep_worker, 4, dict(parallel=dict(expert=4)), False, (6, 7),
                              timeout=TIMEOUT)
    _check_ep(results, idle=(6, 7))
    for r in results:
        for res in r.values():
            for name in ('experts.gate', 'experts.up', 'experts.down'):
                grad = res['grads'][name]
                assert grad is not None
                assert (torch.count_nonzero(grad) == 0) == (res['expert_rank'] == 3)


# ------------------------------------------------------------------ expert tensor parallel
def _expert_tensor_run(rank):
    """MoE(h 16, f 32, 4 experts, top-2) under expert 2 x 1D t=2, experts cut over the
    tensor pair (default) and kept whole: local expert shapes, this rank's TENSOR
    all-reduce bytes in one forward + backward, the global tokens per expert, the output."""
    out = {}
    for etp in (None, False):
        torch.manual_seed(SEED)
        moe = MoE(16, 32, 4, 2, expert_tensor_parallel=etp)
        data = gpc.axis(PM.DATA)
        x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(data.rank),
                        requires_grad=True)
        with comm_profile() as stats:
            y = moe(x)
            y.square().sum().backward()
        out[etp] = dict(gate=tuple(moe.experts.gate.shape), down=tuple(moe.experts.down.shape),
                        tensor_bytes=stats.bytes(PM.TENSOR, 'all_reduce'),
                        expert_rank=moe.expert_axis.rank, tokens=moe.last_tokens_per_expert,
                        y=y.detach())
    return out


def test_expert_tensor_parallel_cuts_the_width_and_all_reduces_the_rows():
    """Under 1D t=2 each expert's width is cut over the tensor pair (gate/up [2, 16, 16],
    down [2, 16, 16] per rank at E=2) and the rows the rank's experts process are
    all-reduced over TENSOR once forward and once backward: 2 x 4 x h x rows bytes, rows
    being the global tokens routed to its 2 experts. ``expert_tensor_parallel=False``
    keeps the experts whole ([2, 16, 32]) and communicates nothing over TENSOR; both give
    the same output. (Equality with the serial Llama: test_llama_moe.py, expert2-tp2.)"""
    results = run_distributed(_expert_tensor_run, 4,
                              dict(parallel=dict(expert=2, tensor=dict(size=2, mode='1d'))),
                              timeout=TIMEOUT)
    for r in results:
        cut, whole = r[None], r[False]
        assert (cut['gate'], cut['down']) == ((2, 16, 16), (2, 16, 16))
        assert (whole['gate'], whole['down']) == ((2, 16, 32), (2, 32, 16))
        local = slice(2 * cut['expert_rank'], 2 * cut['expert_rank'] + 2)
        rows = int(cut['tokens'][local].sum())
        assert rows > 0 and cut['tensor_bytes'] == 2 * 4 * 16 * rows
        assert whole['tensor_bytes'] == 0
        assert max_rel_diff(cut['y'], whole['y']) <= TOL


def _sequence_parallel_run(rank):
    """MoE(h 16, f 32, 4 experts, top-2) under expert 2 x 1D t=2 with sequence parallelism:
    this rank's block of x [4, 6, 16] in, its block out; the 1D group's all_gather bytes."""
    torch.manual_seed(SEED)
    moe = MoE(16, 32, 4, 2)
    data, tensor = gpc.axis(PM.DATA), moe.sequence_axis
    full = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(data.rank))
    x = full[:, 3 * tensor.rank:3 * tensor.rank + 3].clone().requires_grad_()
    with comm_profile() as stats:
        y = moe(x)
        y.square().sum().backward()
    with torch.no_grad():
        whole = moe._routed(full)   # what 1D without sequence parallelism computes
    return dict(y=y.detach(), block=whole[:, 3 * tensor.rank:3 * tensor.rank + 3],
                gathered=stats.bytes(tensor.mode, 'all_gather'),
                x_grad=x.grad is not None and torch.count_nonzero(x.grad).item())


def test_sequence_parallel_routes_whole_sequences_and_keeps_the_block():
    """1D sequence parallelism: the block's output is the block of the routed output of the
    whole sequences (what plain 1D computes), at the cost of two all_gathers of [b, s, h]
    over the 1D group (x forward, the output's gradient backward): 2 x 4 x 4 x 6 x 16 bytes."""
    layout = dict(expert=2, tensor=dict(size=2, mode='1d', sequence_parallel=True))
    for r in run_distributed(_sequence_parallel_run, 4, dict(parallel=layout), timeout=TIMEOUT):
        assert max_rel_diff(r['y'], r['block']) <= TOL
        assert r['gathered'] == 2 * 4 * 4 * 6 * 16
        assert r['x_grad'] > 0
