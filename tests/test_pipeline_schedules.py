"""Pipeline schedules as data: every generated schedule passes the dry run, broken ones do not,
and the simulated idle fractions and activation peaks equal the schedule table's formulas
(``colossal_lite/config/schedules.py``, docs/pipeline.md); the schedule modules import no
cycle."""
import ast
import os

import pytest

from colossal_lite.config.schedules import SCHEDULES, check_schedule, default_schedule, w_waiting

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
    ('1f1b', 4, 3, 1, 'needs num_microbatches >= pipeline size 4, got num_microbatches = 3'),
    ('interleaved', 4, 6, 2, 'divisible by the pipeline size 4, got num_microbatches = 6'),
    ('1f1b', 2, 4, 2, "'parallel.pipeline.chunks' = 2 needs schedule 'interleaved'"),
    ('pipedream', 2, 4, 1, "unknown pipeline schedule 'pipedream'"),
])
def test_impossible_combinations_are_named(name, P, M, V, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(name, P, M, V)


@pytest.mark.parametrize('name, P, V, M', [
    ('gpipe', 4, 1, 8), ('1f1b', 4, 1, 8), ('1f1b', 4, 1, 3 + 4), ('zero_bubble', 4, 1, 8),
    ('zero_bubble', 8, 1, 8), ('interleaved', 4, 2, 8), ('interleaved', 2, 4, 4),
    ('interleaved', 4, 2, 4)])
def test_the_table_formulas_are_the_simulated_schedules(name, P, V, M):
    """Each table row's idle fraction and peak in-flight micro-batches (in chunk units: x V)
    are what the dry run of the generated lists gives, on every rank."""
    row = SCHEDULES[name]
    idle, result = _idle(name, P, M, V)
    assert all(abs(f - row.idle_fraction(P, M, V)) < 1e-12 for f in idle), (name, idle)
    assert result.peak_in_flight == {r: round(row.in_flight(P, M, V, r) * V)
                                     for r in range(P)}, name
    assert row.split_backward == (name == 'zero_bubble')


def test_the_table_checks_name_the_key_and_value():
    assert default_schedule(1) == '1f1b' and default_schedule(2) == 'interleaved'
    assert check_schedule('pipedream', 2, 1, 4) == (
        "'parallel.pipeline.schedule' must be one of ['1f1b', 'gpipe', 'interleaved', "
        "'zero_bubble'], got 'pipedream'")
    assert check_schedule('gpipe', 4, 1, 2) is None                 # GPipe runs M < P
    assert check_schedule('zero_bubble', 4, 1, 2).startswith("pipeline schedule 'zero_bubble' "
                                                             "needs num_microbatches >= ")
    assert check_schedule('interleaved', 1, 2, 3) is None           # no pipeline: no M rule
    assert SCHEDULES['1f1b'].zero3_check(2, 1) is None
    assert SCHEDULES['gpipe'].zero3_check(2, 1) is None
    assert SCHEDULES['zero_bubble'].zero3_check(1, 1) is None       # no pipeline
    assert SCHEDULES['zero_bubble'].zero3_check(2, 1) == (
        "ZeRO stage 3 with pipeline parallelism runs the '1f1b' and 'gpipe' schedules with one "
        "stage per rank, got schedule 'zero_bubble' with chunks = 1")
    assert w_waiting('zero_bubble', 4, 8, 1) == 2 and w_waiting('1f1b', 4, 8, 1) == 0
    # the pipeline time: M stage times plus each schedule's bubble
    assert SCHEDULES['1f1b'].pipeline_time(4, 8, 1, 1.0, 0.3) == 11
    assert SCHEDULES['interleaved'].pipeline_time(4, 8, 2, 1.0, 0.3) == 9.5
    assert SCHEDULES['zero_bubble'].pipeline_time(4, 8, 1, 1.0, 0.3) == pytest.approx(8.9)
    assert SCHEDULES['gpipe'].pipeline_time(1, 8, 1, 1.0, 0.3) == 8


def _imports(path):
    """Every module a file imports, function-local imports included (relative ones resolved
    inside ``colossal_lite``)."""
    package = os.path.relpath(os.path.dirname(path), _ROOT).replace(os.sep, '.')
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split('.')[:len(package.split('.')) - node.level + 1] if node.level \
                else []
            module = '.'.join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f'{module}.{alias.name}' for alias in node.names)  # from . import x
    return out


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_schedule_modules_import_no_cycle():
    """actions <- generators, simulator <- zero_bubble <- schedules, counting imports inside
    functions; the table and the vocabulary import nothing from colossal_lite."""
    names = ['actions', 'generators', 'simulator', 'zero_bubble', 'schedules']
    files = {f'colossal_lite.pipeline.{n}': os.path.join(_ROOT, 'colossal_lite', 'pipeline',
                                                         f'{n}.py') for n in names}
    files['colossal_lite.config.schedules'] = os.path.join(_ROOT, 'colossal_lite', 'config',
                                                           'schedules.py')
    graph = {m: {i for i in _imports(path) if i in files and i != m} for m, path in files.items()}
    for leaf in ('colossal_lite.pipeline.actions', 'colossal_lite.config.schedules'):
        assert not [i for i in _imports(files[leaf]) if i.startswith('colossal_lite')], leaf
    assert graph['colossal_lite.pipeline.simulator'] == {'colossal_lite.pipeline.actions'}
    assert graph['colossal_lite.pipeline.zero_bubble'] == {'colossal_lite.pipeline.actions',
                                                           'colossal_lite.pipeline.generators'}
    done = set()
    while len(done) < len(graph):                  # peel modules whose imports are all done
        ready = {m for m in graph if m not in done and graph[m] <= done}
        assert ready, f'import cycle among {sorted(set(graph) - done)}'
        done |= ready
