"""The serial-vs-parallel harness can fail: it names the first step and key that differ,
refuses missing or extra keys and NaNs, merges per-rank traces (pipeline stages holding
some parameters, replicas that must agree) and records what a step returns."""
import pytest
import torch

from colossal_lite.nn.parallel_1d import ColumnLinear1D
from colossal_lite.testing import (Trace, assert_matches_serial, merge_traces, plain_step,
                                   run_distributed, training_trace)


def _trace(**scale):
    """Two steps of a fake run; ``scale`` multiplies the named keys at step 1."""
    steps = []
    for step in range(2):
        record = {'loss': torch.tensor(2.0 - step), 'grad:w': torch.full((3,), 0.5 + step),
                  'param:w': torch.arange(3.0) + step, 'param:b': torch.tensor([step * 1.0])}
        if step == 1:
            record = {k: v * scale.get(k.split(':')[-1], 1.0) for k, v in record.items()}
        steps.append(record)
    return Trace(steps)


def test_equal_traces_pass_and_the_first_difference_is_named():
    assert_matches_serial(_trace(), _trace())
    assert_matches_serial(_trace(w=1 + 1e-6), _trace())          # 1.5e-6 / 1.5 <= 1e-5
    bad = _trace(w=1.1)
    bad[1]['param:b'] = torch.tensor([1.5])
    with pytest.raises(AssertionError, match=r'step 1 grad:w \(rank 0\) differs from serial '
                                             r'by 0\.1 > 1e-05; 3 of 8 values differ, the '
                                             r'worst step 1 param:b \(rank 0\) by 0\.5'):
        assert_matches_serial(bad, _trace())   # 0.15 / max(1, 1.5); 0.3 / 3; 0.5 / 1
    assert_matches_serial(bad, _trace(), dict(grad=0.11, param=0.5, default=0.0))
    with pytest.raises(KeyError, match="no tolerance for 'loss'"):
        assert_matches_serial(_trace(), _trace(), dict(grad=1.0))


def test_missing_extra_keys_steps_and_nan_fail():
    short = Trace(_trace().steps[:1])
    with pytest.raises(AssertionError, match='recorded 1 steps, the serial one 2'):
        assert_matches_serial(short, _trace())
    extra = _trace()
    extra[1]['grad:v'] = torch.zeros(1)
    with pytest.raises(AssertionError, match=r"step 1: keys only in the serial trace: \[\]; "
                                             r"only in the parallel trace: \['grad:v'\]"):
        assert_matches_serial(extra, _trace())
    with pytest.raises(AssertionError, match=r"only in the serial trace: \['grad:v'\]"):
        assert_matches_serial(_trace(), extra)
    nan = _trace()
    nan[0]['param:b'] = torch.tensor([float('nan')])
    with pytest.raises(AssertionError, match='step 0 param:b .* by inf'):
        assert_matches_serial(nan, _trace())


def _stage(keep, full=None):
    full = full or _trace()
    return Trace([{k: v for k, v in s.items() if keep(k)} for s in full.steps])


def test_per_rank_traces_merge_by_key_and_replicas_must_agree():
    """Two 'stages': the first holds w, the last b and the loss; a replica of each."""
    first, last = _stage(lambda k: k.endswith(':w')), _stage(lambda k: not k.endswith(':w'))
    ranks = [first, last, first, last]
    merged = merge_traces(ranks)
    assert all(set(m) == set(s) for m, s in zip(merged.steps, _trace().steps))
    assert_matches_serial(ranks, _trace())
    with pytest.raises(AssertionError, match=r"only in the serial trace: \['grad:w', "):
        assert_matches_serial([last, last], _trace())
    drifted = _stage(lambda k: k.endswith(':w'), _trace(w=1 + 8e-6))
    with pytest.raises(AssertionError, match=r'step 1 grad:w: rank 2 differs from rank 0'):
        merge_traces([first, last, drifted, last], tol=1e-6)
    with pytest.raises(AssertionError, match=r'step 1 grad:w \(rank 2\)'):
        assert_matches_serial([first, last, _stage(lambda k: ':w' in k, _trace(w=2.0)), last],
                              _trace())


def test_training_trace_records_every_step_and_what_the_step_returns():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    trace = training_trace(model, (x, y), torch.nn.functional.mse_loss, steps=3,
                           detail_steps=(0, 2))
    assert [sorted(s) for s in trace.steps] == [
        ['grad:bias', 'grad:weight', 'loss', 'output.0', 'param:bias', 'param:weight'],
        ['loss'], ['grad:bias', 'grad:weight', 'loss', 'output.0', 'param:bias',
                    'param:weight']]
    assert torch.equal(trace.named(2, 'param')['weight'], model.weight.detach())
    assert trace[0]['loss'] > trace[2]['loss']

    def step(model, batch):
        return {'loss': torch.tensor(1.0), 'moments': {'weight': torch.ones(2)}, 'norm': 3}
    trace = training_trace(model, (x, y), steps=1, step_fn=step)
    moments = trace.named(0, 'moments')
    assert list(moments) == ['weight'] and torch.equal(moments['weight'], torch.ones(2))
    assert trace[0]['norm'] == 3 and 'grad:weight' in trace[0]
    with pytest.raises(ValueError, match='needs loss_fn'):
        training_trace(model, (x, y))


def _column_trace(rank, wrong_rank):
    torch.manual_seed(0)
    layer = ColumnLinear1D(4, 8, gather_output=True)
    if rank == wrong_rank:   # a bug in one rank's shard of the gradient
        layer.weight.register_hook(lambda g: g * 1.001)
    batch = (torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 8))
    return training_trace(layer, batch, steps=2,
                          step_fn=plain_step(torch.nn.functional.mse_loss,
                                             torch.optim.SGD(layer.parameters(), lr=0.1)))


def test_a_wrong_gradient_on_one_tensor_parallel_rank_is_caught():
    serial = _column_trace(0, None)
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    assert_matches_serial(run_distributed(_column_trace, 2, config, None, timeout=120), serial)
    with pytest.raises(AssertionError, match=r'step 0 grad:weight \(rank 0\)'):
        assert_matches_serial(run_distributed(_column_trace, 2, config, 1, timeout=120), serial)
