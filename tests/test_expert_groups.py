"""Expert parallelism's plumbing: the EXPERT / EXPERT_DATA groups, the config checks, the
gradient sum of expert parameters, clipping, ZeRO, token all_to_all and checkpoints.

Layout tests need no process. The engine tests train a toy module with one expert
parameter ``[4, 3]`` (cut along rows over EXPERT: each rank holds the rows of its EXPERT
rank) and one dense parameter ``[2]`` on a loss linear in both, so every rank's gradient is
a known number independent of the weights; after the engine's sync, clipping and an SGD step
every full weight must equal the hand-computed one: the expert rows of EXPERT rank ``e``
move by the sum over their EXPERT_DATA group of the ranks' gradients / data size, the dense
weight by the sum over all ranks / data size, both scaled by the clip coefficient of the
norm that counts each expert row once.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import colossal_lite as clt
from colossal_lite import checkpoint, cli
from colossal_lite.checkpoint import state as S
from colossal_lite.communication import all_to_all, all_to_all_rows, comm_profile
from colossal_lite.config import ConfigError, load_config, parse_parallel
from colossal_lite.context import ParallelContext, ParallelMode as PM, global_context as gpc
from colossal_lite.context import use_context
from colossal_lite.context.layout import build_groups, coordinates, mode_axes
from colossal_lite.tensor import Placement, ShardedModule, new_parameter, param_placement
from colossal_lite.testing import run_distributed

EXPERTS = 4                     # rows of the expert parameter (experts of the serial model)
CLIP = 1.0
LR = 0.5
STEPS = 2
TIMEOUT = 180


def _layout(world, **parallel):
    return parse_parallel(parallel).with_world_size(world)


# ----------------------------------------------------------------------------- groups
def test_groups_data4_expert2_1d2_pipeline2():
    """world 16 = pipeline 2 x data 4 x 1D tensor 2, E = 2: rank = 8 pipe + 4 expert_data +
    2 expert + t. EXPERT pairs consecutive data coordinates, EXPERT_DATA the replicas."""
    groups = build_groups(_layout(16, expert=2, pipeline=2, tensor=dict(size=2, mode='1d')))
    assert groups[PM.EXPERT] == [(0, 2), (1, 3), (4, 6), (5, 7),
                                 (8, 10), (9, 11), (12, 14), (13, 15)]
    assert groups[PM.EXPERT_DATA] == [(0, 4), (1, 5), (2, 6), (3, 7),
                                      (8, 12), (9, 13), (10, 14), (11, 15)]
    assert groups[PM.DATA] == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]


@pytest.mark.parametrize('world, parallel', [
    (16, dict(pipeline=2, tensor=dict(size=2, mode='1d'))),
    (8, dict()),
    (8, dict(tensor=dict(size=2, mode='sequence'))),
    (16, dict(tensor=dict(size=4, mode='ulysses', ring=2))),
])
def test_unfolding_keeps_every_other_group_and_local_rank(world, parallel):
    """E = 2 changes no group but EXPERT and EXPERT_DATA: DATA (and SEQUENCE_DP) keep
    their members and order, so every local rank and the data coordinate are unchanged."""
    folded, unfolded = _layout(world, **parallel), _layout(world, expert=2, **parallel)
    before, after = build_groups(folded), build_groups(unfolded)
    assert set(before) == set(after)
    for mode in before:
        if mode not in (PM.EXPERT, PM.EXPERT_DATA):
            assert before[mode] == after[mode], mode
    for rank in range(world):
        assert coordinates(unfolded, rank)['data'] == coordinates(folded, rank)['data']


@pytest.mark.parametrize('world, parallel, sequence', [
    (8, dict(), False), (16, dict(pipeline=2, tensor=dict(size=2, mode='1d')), False),
    (8, dict(tensor=dict(size=2, mode='sequence')), True)])
def test_expert_one_builds_single_rank_expert_groups(world, parallel, sequence):
    groups = build_groups(_layout(world, **parallel))
    assert groups[PM.EXPERT] == [(r,) for r in range(world)]
    assert groups[PM.EXPERT_DATA] == groups[PM.SEQUENCE_DP if sequence else PM.DATA]


def test_sequence_mode_expert_data_spans_the_sequence_ranks():
    """mode 'sequence' t=2, data 4, E=2 (world 8: rank = 4 expert_data + 2 expert + t): the
    t ranks hold other tokens of the same samples, so an expert's gradient is summed over
    expert_data x t, as SEQUENCE_DP sums dense ones over data x t."""
    groups = build_groups(_layout(8, expert=2, tensor=dict(size=2, mode='sequence')))
    assert groups[PM.EXPERT] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups[PM.EXPERT_DATA] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert groups[PM.SEQUENCE_DP] == [tuple(range(8))]


def test_expert_placement_and_its_dtensor_spec():
    """A parameter cut over EXPERT (1D t=2, data 4, E=2, rank 6 = expert_data 1, expert 1,
    t 0): replicated over EXPERT_DATA and PARALLEL_1D, its gradient summed over EXPERT_DATA;
    on the mesh it is Shard(0) on 'expert' only."""
    layout = _layout(8, expert=2, tensor=dict(size=2, mode='1d'))
    with use_context(ParallelContext.describe(layout, rank=6)):
        p = new_parameter((EXPERTS, 3), (0, PM.EXPERT), init=_expert_init)
    placement = param_placement(p)
    assert placement == Placement((4, 3), ((0, PM.EXPERT),), (PM.EXPERT_DATA, PM.PARALLEL_1D),
                                  (PM.EXPERT_DATA,))
    assert torch.equal(p.detach(), _expert_values()[2:4])
    spec = placement.dtensor_spec(('expert_data', 'expert', 't'), mode_axes(layout))
    assert spec == [Replicate(), Shard(0), Replicate()]
    assert Placement.from_json(placement.to_json()) == placement


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize('parallel, error, message', [
    (dict(expert=0), ConfigError, "'parallel.expert' must be a positive integer, got 0"),
    (dict(expert=2.0), ConfigError, "'parallel.expert' must be a positive integer, got 2.0"),
    (dict(expert=3, data=4), ConfigError,
     "'parallel.expert' = 3 must divide the data-parallel size 'parallel.data' = 4: expert "
     "parallelism is carved out of the data axis only"),
    (dict(expert=2, tensor=dict(size=4, mode='2d')), NotImplementedError,
     "'parallel.expert' = 2 with tensor mode '2d' is not supported"),
    (dict(expert=2, auto=dict()), ConfigError,
     "'parallel.expert' = 2 cannot be combined with 'parallel.auto'"),
])
def test_bad_expert_configs_name_the_key_and_values(parallel, error, message):
    with pytest.raises(error) as info:
        load_config(dict(parallel=parallel)).settings
    assert message in str(info.value)


def test_expert_not_dividing_the_data_size_fails_at_launch_before_any_group():
    layout = parse_parallel(dict(expert=4, pipeline=2))
    with pytest.raises(ConfigError) as info:
        layout.with_world_size(12)
    assert str(info.value) == (
        "'parallel.expert' = 4 must divide the data-parallel size data = 6 (= world size 12 / "
        "(pipeline*tensor = 2*1)): expert parallelism is carved out of the data axis only")
    with pytest.raises(ConfigError, match=r"'parallel.expert' = 4 must divide .* data = 6"):
        clt.launch(dict(parallel=dict(expert=4, pipeline=2), num_microbatches=2), 0, 12,
                   'localhost', 1)
    assert not gpc.is_initialized(PM.DATA)


def test_cli_checks_expert_before_any_process_starts(tmp_path):
    path = tmp_path / 'job.py'
    path.write_text("parallel = dict(expert=4, pipeline=2)\nnum_microbatches = 2\n"
                    "model = dict(type='gpt', preset='tiny')\n")
    with pytest.raises(ConfigError, match=r"'parallel.expert' = 4 must divide the data-parallel "
                                          r"size data = 3 .*: run with --nproc 8$"):
        cli.check_job(str(path), 6, None)


# ----------------------------------------------------------------------------- the toy model
def _expert_values() -> torch.Tensor:
    return torch.arange(EXPERTS * 3, dtype=torch.float32).view(EXPERTS, 3) * 0.1


def _expert_init(full, generator=None):
    with torch.no_grad():
        full.copy_(_expert_values())


DENSE = torch.tensor([0.5, -0.5])


class ExpertToy(ShardedModule):
    """``expert`` [4, 3] cut over EXPERT (rows), ``dense`` [2] whole; the loss is linear:
    ``sum(expert_local * a) + sum(dense * b)``, so the local gradients are ``a`` and ``b``."""

    def __init__(self):
        super().__init__()
        self.expert = new_parameter((EXPERTS, 3), (0, PM.EXPERT), init=_expert_init)
        self.dense = nn.Parameter(DENSE.clone())

    def forward(self, a, b):
        return (self.expert * a).sum() + (self.dense * b).sum()


def _rows(e, experts_per_rank):
    return slice(e * experts_per_rank, (e + 1) * experts_per_rank)


def _local_grads(rank, rows):
    """The known per-rank gradients: expert ``(r + 1) * 100 + 10 i + j``, dense
    ``[r + 1, 2 - r]``."""
    i = torch.arange(rows).view(rows, 1).float()
    j = torch.arange(3).view(1, 3).float()
    return (rank + 1) * 100 + 10 * i + j, torch.tensor([rank + 1.0, 2.0 - rank])


def _engine_worker(rank, zero):
    torch.manual_seed(0)
    model = ExpertToy()
    with torch.no_grad():   # replicas disagree before initialize: its broadcast must fix it
        model.expert.add_(10.0 * rank)
        model.dense.add_(10.0 * rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = clt.initialize(model, optimizer)
    rows = EXPERTS // gpc.get_world_size(PM.EXPERT)
    a, b = _local_grads(rank, rows)
    after_init = {k: v.clone() for k, v in engine.model.state_dict().items()}
    norms, grads = [], None
    for _ in range(STEPS):
        engine.zero_grad()
        engine.backward(engine(a, b))
        assert engine.step()
        norms.append(engine.last_grad_norm)
        if not zero:
            grads = (engine.model.expert.grad.clone(), engine.model.dense.grad.clone())
    return dict(after_init=after_init, state=engine.model.state_dict(), norms=norms,
                grads=grads, expert_rank=gpc.get_local_rank(PM.EXPERT))


# (config, world, data size, EXPERT rank of each global rank, EXPERT_DATA groups)
ENGINE_CASES = {
    'dp4-e2': (dict(parallel=dict(expert=2)), 4, 4, [0, 1, 0, 1], [(0, 2), (1, 3)]),
    'dp2-e2': (dict(parallel=dict(expert=2)), 2, 2, [0, 1], [(0,), (1,)]),
    'dp4-e4': (dict(parallel=dict(expert=4)), 4, 4, [0, 1, 2, 3], [(0,), (1,), (2,), (3,)]),
    'seq2-dp2-e2': (dict(parallel=dict(expert=2, tensor=dict(size=2, mode='sequence'))), 4, 2,
                    [0, 0, 1, 1], [(0, 1), (2, 3)]),
    'dp4-e2-zero1': (dict(parallel=dict(expert=2), zero=dict(stage=1)), 4, 4, [0, 1, 0, 1],
                     [(0, 2), (1, 3)]),
    'dp4-e2-zero2': (dict(parallel=dict(expert=2), zero=dict(stage=2)), 4, 4, [0, 1, 0, 1],
                     [(0, 2), (1, 3)]),
    'dp4-e2-zero3': (dict(parallel=dict(expert=2), zero=dict(stage=3, placement='cpu')), 4, 4,
                     [0, 1, 0, 1], [(0, 2), (1, 3)]),
}


def _expected(world, data, expert_rank, expert_data_groups):
    """Hand-computed full weights after initialize and after the steps, the synced local
    gradients and the norm."""
    e_size = max(expert_rank) + 1
    per = EXPERTS // e_size
    initial = _expert_values()
    full_grad = torch.zeros(EXPERTS, 3)
    for group in expert_data_groups:
        e = expert_rank[group[0]]
        assert all(expert_rank[r] == e for r in group)
        initial[_rows(e, per)] += 10.0 * group[0]     # broadcast from EXPERT_DATA rank 0
        full_grad[_rows(e, per)] = sum(_local_grads(r, per)[0] for r in group) / data
    dense_grad = sum(_local_grads(r, per)[1] for r in range(world)) / data
    norm = math.sqrt(full_grad.pow(2).sum().item() + dense_grad.pow(2).sum().item())
    coef = min(1.0, CLIP / (norm + 1e-6))
    return dict(initial={'expert': initial, 'dense': DENSE.clone()},
                final={'expert': initial - STEPS * LR * coef * full_grad,
                       'dense': DENSE - STEPS * LR * coef * dense_grad},
                grad={'expert': coef * full_grad, 'dense': coef * dense_grad}, norm=norm, per=per)


@pytest.mark.parametrize('case', list(ENGINE_CASES))
def test_expert_gradients_sum_over_expert_data_and_clip_counts_each_row_once(case):
    config, world, data, expert_rank, groups = ENGINE_CASES[case]
    config = dict(config, clip_grad_norm=CLIP)
    results = run_distributed(_engine_worker, world, config, 'zero' in config,
                              timeout=TIMEOUT)
    want = _expected(world, data, expert_rank, groups)
    assert want['norm'] > 10 * CLIP   # clipping acts
    for rank, res in enumerate(results):
        assert res['expert_rank'] == expert_rank[rank]
        for key in ('expert', 'dense'):
            assert torch.allclose(res['after_init'][key], want['initial'][key], atol=1e-6), \
                (rank, key, 'after initialize')
            assert torch.allclose(res['state'][key], want['final'][key], atol=1e-5), \
                (rank, key, res['state'][key], want['final'][key])
        assert all(abs(n - want['norm']) <= 1e-5 * want['norm'] for n in res['norms']), \
            (rank, res['norms'], want['norm'])
        if res['grads'] is not None:
            rows = _rows(expert_rank[rank], want['per'])
            assert torch.allclose(res['grads'][0], want['grad']['expert'][rows], atol=1e-6)
            assert torch.allclose(res['grads'][1], want['grad']['dense'], atol=1e-6)


# ----------------------------------------------------------------------------- all_to_all
def _all_to_all_worker(rank):
    """EXPERT local rank k sends ``k + 1`` rows to local rank 0 and 2 rows to local rank 1
    (counts exchanged first); rows ``[r, k, n]`` name their origin."""
    k = gpc.get_local_rank(PM.EXPERT)
    send = torch.tensor([k + 1, 2])
    with comm_profile() as stats:
        recv = all_to_all(send, PM.EXPERT, 0, 0)
        n = int(send.sum())
        x = torch.stack([torch.full((n,), float(rank)), torch.full((n,), float(k)),
                         torch.arange(n).float()], 1).requires_grad_()
        y = all_to_all_rows(x, PM.EXPERT, send.tolist(), recv.tolist())
        (y * y).sum().backward()   # each row's gradient is 2 * the row, sent back
    return dict(recv=recv.tolist(), y=y.detach(), grad_ok=torch.equal(x.grad, 2 * x.detach()),
                expert=stats.bytes(PM.EXPERT, 'all_to_all'), total=stats.bytes(),
                calls=stats.calls(PM.EXPERT, 'all_to_all'), rows=(n, y.shape[0]))


def test_token_all_to_all_over_expert_is_exact_and_counted_under_expert():
    results = run_distributed(_all_to_all_worker, 4, dict(parallel=dict(expert=2)),
                              timeout=TIMEOUT)
    for rank, res in enumerate(results):
        k, base = rank % 2, rank - rank % 2       # EXPERT groups (0, 1), (2, 3)
        want_recv = [1, 2] if k == 0 else [2, 2]
        assert res['recv'] == want_recv
        rows = []
        for j in range(2):                         # from local rank j, in rank order
            first = (j + 1) if k == 1 else 0     # local rank 1's rows come after the k+1
            rows += [[base + j, j, first + m] for m in range(want_recv[j])]
        assert torch.equal(res['y'], torch.tensor(rows, dtype=torch.float32)), (rank, res['y'])
        assert res['grad_ok']
        sent, received = res['rows']
        # counts (2 int64) + rows forward (3 fp32 each) + gradient rows backward
        assert res['expert'] == 2 * 8 + sent * 12 + received * 12
        assert res['total'] == res['expert'] and res['calls'] == 3


# ----------------------------------------------------------------------------- checkpoints
def _checkpoint_engine():
    torch.manual_seed(0)
    model = ExpertToy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, eps=1.0)
    config = None if gpc.is_initialized() else {}   # {}: a serial run without launch()
    engine, *_ = clt.initialize(model, optimizer, config=config)
    return engine


def _save_worker(rank, path):
    engine = _checkpoint_engine()
    rows = EXPERTS // gpc.get_world_size(PM.EXPERT)
    a, b = _local_grads(rank, rows)
    engine.zero_grad()
    engine.backward(engine(a, b))
    engine.step()
    checkpoint.save(path, engine)
    return {k: v.detach().cpu().clone() for k, v in S.tensor_state(engine).items()}


def _load_worker(rank, path):
    engine = _checkpoint_engine()
    checkpoint.load(path, engine)
    return {k: v.detach().cpu().clone() for k, v in S.tensor_state(engine).items()}


E4, E2 = dict(parallel=dict(expert=4)), dict(parallel=dict(expert=2))


@pytest.mark.parametrize('src, dst', [
    (E4, E2), (dict(E2, zero=dict(stage=3, placement='cpu')), E4)],
    ids=['e4-to-e2-and-serial', 'e2-zero3-to-e4-and-serial'])
def test_checkpoint_reshards_across_expert_sizes_and_to_serial(tmp_path, src, dst):
    """Saved after one AdamW step on 4 ranks, loaded on 4 ranks with another E and in this
    process without a launch: the same full weights and Adam slots, bit for bit."""
    path = str(tmp_path / 'ckpt')
    saved = run_distributed(_save_worker, 4, src, path, timeout=TIMEOUT)
    for state in saved[1:]:
        assert set(state) == set(saved[0])
        assert all(torch.equal(state[k], saved[0][k]) for k in state)
    want = saved[0]
    assert want['model.expert'].shape == (EXPERTS, 3)
    assert not torch.equal(want['model.expert'], _expert_values())   # it trained
    assert 'optim.expert.exp_avg' in want
    if 'zero' not in src:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        # DTensor shards over the mesh's 'expert' dim: one [1, 3] chunk per expert row
        for key in ('model.expert', 'optim.expert.exp_avg'):
            assert sorted(tuple(c.offsets) for c in meta[key].chunks) == \
                [(r, 0) for r in range(4)]
    loaded = run_distributed(_load_worker, 4, dst, path, timeout=TIMEOUT)
    serial = _load_worker(0, path)    # this process: no launch, full tensors
    for state in loaded + [serial]:
        assert set(state) == set(want)
        for key, value in want.items():
            assert torch.equal(state[key].to(value.dtype), value), key
