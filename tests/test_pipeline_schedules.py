"""Pipeline schedules as data: every generated schedule passes the dry run, broken ones do not,
and the simulated idle fractions equal the bubble formulas of docs/pipeline.md."""
import pytest

from colossal_lite.pipeline import (Action, PipeShape, ScheduleError, build_schedule,
                                    compute_orders, lower, simulate)


def _shapes():
    for name in ('gpipe', '1f1b', 'zero_bubble', 'interleaved'):
        for P in range(1, 9):
            for V in (range(1, 5) if name == 'interleaved' else (1,)):
                for M in range(1, 33):
                    if name != 'gpipe' and M < P or name == 'interleaved' and M % P:
                        continue
                    yield name, P, V, M


def test_every_generated_schedule_passes_the_dry_run():
    count = 0
    for name, P, V, M in _shapes():
        shape = PipeShape(P, V, M)
        result = simulate(shape, build_schedule(name, P, M, V))
        assert result.makespan > 0
        count += 1
    assert count > 700


def _idle(name, P, M, V=1):
    shape = PipeShape(P, V, M)
    result = simulate(shape, build_schedule(name, P, M, V))
    return [result.idle_fraction(r) for r in range(P)], result


@pytest.mark.parametrize('P, M', [(2, 2), (4, 4), (4, 7), (4, 16), (8, 8), (8, 32)])
def test_gpipe_and_1f1b_idle_fraction_is_the_bubble_formula(P, M):
    for name in ('gpipe', '1f1b'):
        idle, result = _idle(name, P, M)
        assert all(abs(f - (P - 1) / (M + P - 1)) < 1e-12 for f in idle), (name, idle)
    _, gpipe = _idle('gpipe', P, M)
    _, one_f = _idle('1f1b', P, M)
    assert gpipe.peak_in_flight == {r: M for r in range(P)}
    assert one_f.peak_in_flight == {r: min(M, P - r) for r in range(P)}


@pytest.mark.parametrize('P, V, M', [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 32)])
def test_interleaved_idle_fraction(P, V, M):
    idle, _ = _idle('interleaved', P, M, V)
    assert all(abs(f - (P - 1) / (V * M + P - 1)) < 1e-12 for f in idle), idle


@pytest.mark.parametrize('P, M', [(2, 2), (4, 4), (4, 16), (8, 8), (8, 32)])
def test_zero_bubble_h1_bubble_and_memory(P, M):
    """ZB-H1: idle time (P-1)(T_F + T_B - T_W) = P-1 units against 1F1B's 3(P-1); peak
    in-flight micro-batches at most P (1F1B's peak, on its first rank)."""
    idle, result = _idle('zero_bubble', P, M)
    busy = 3 * M
    assert all(abs(f - (P - 1) / (busy + P - 1)) < 1e-12 for f in idle), idle
    assert max(result.peak_in_flight.values()) == min(P, M)
    one_f, _ = _idle('1f1b', P, M)
    if P > 1:
        assert max(idle) < 0.5 * min(one_f)


def _lowered(name='1f1b', P=2, M=2):
    shape = PipeShape(P, 1, M)
    return shape, lower(shape, compute_orders(name, shape))


def test_the_dry_run_rejects_crossed_receives():
    shape, actions = _lowered()
    # rank 1 waits for a gradient before sending the activation rank 0 waits for
    swapped = [Action('RECV_B', 0, 0)] + [a for a in actions[0] if a != Action('RECV_B', 0, 0)]
    actions[0] = swapped
    with pytest.raises(ScheduleError, match='deadlock|needs'):
        simulate(shape, actions)


def test_the_dry_run_rejects_a_missing_send_and_a_missing_receive():
    shape, actions = _lowered()
    actions[0] = [a for a in actions[0] if a != Action('SEND_F', 0, 1)]
    with pytest.raises(ScheduleError, match='deadlock'):
        simulate(shape, actions)
    shape, actions = _lowered()
    actions[1] = [a for a in actions[1] if a != Action('RECV_F', 1, 0)]
    with pytest.raises(ScheduleError, match='activation of stage 0'):
        simulate(shape, actions)


def test_the_dry_run_rejects_wrong_order_and_repeats():
    shape, actions = _lowered('gpipe', P=1, M=2)
    actions[0] = [Action('B', 0, 0)] + [a for a in actions[0] if a != Action('B', 0, 0)]
    with pytest.raises(ScheduleError, match='backward before its forward'):
        simulate(shape, actions)
    shape, actions = _lowered('gpipe', P=1, M=2)
    actions[0] = actions[0] + [Action('F', 0, 1)]
    with pytest.raises(ScheduleError, match='runs twice'):
        simulate(shape, actions)
    shape, actions = _lowered('gpipe', P=1, M=2)
    actions[0] = actions[0][:-1]
    with pytest.raises(ScheduleError, match='never computed'):
        simulate(shape, actions)


@pytest.mark.parametrize('name, P, M, V, match', [
    ('1f1b', 4, 3, 1, 'needs num_microbatches >= pipeline size 4, got 3'),
    ('interleaved', 4, 6, 2, 'divisible by the pipeline size 4, got 6'),
    ('1f1b', 2, 4, 2, "chunks=2 needs schedule 'interleaved'"),
    ('pipedream', 2, 4, 1, "unknown pipeline schedule 'pipedream'"),
])
def test_impossible_combinations_are_named(name, P, M, V, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(name, P, M, V)
