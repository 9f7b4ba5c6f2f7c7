"""The one local launcher (``colossal_lite.launcher``): how it starts processes and why, what a
rank inherits from its caller, and that a hang or a dead rank is a failure that says where
and why -- also when the launching process (this pytest process) runs threads and launches
back to back."""
import os
import signal
import time

import pytest
import torch

from colossal_lite.launcher import (RANKS, WORKERS, ChildFailed, free_port, run_ranks,
                                    run_workers, start_method)


def test_no_process_is_a_fork_of_the_launching_process():
    assert start_method(WORKERS) == 'spawn'          # direct children: FirstExit waits on them
    assert start_method(RANKS) == 'forkserver'       # forked from a fresh, single-threaded server
    with pytest.raises(ValueError, match="use must be one of"):
        start_method('fork')


def _two_thread_op(rank):
    torch.set_num_threads(2)
    x, m = torch.randn(1 << 22), torch.randn(600, 600)
    return float(x.exp_().sum() + (m @ m).sum())


def test_ranks_started_after_this_process_ran_openmp_do_not_hang():
    """GNU libgomp: a child forked from a process that ran a 2-thread OpenMP region hangs in
    its own first 2-thread region (run_distributed forked this pytest process before and
    timed out here); ranks forked from the launcher's server run it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.randn(1500, 1500)
        (a @ a).sum()
        torch.randn(1 << 22).exp_()
        assert len(run_ranks(_two_thread_op, 2, {}, timeout=60)) == 2
    finally:
        torch.set_num_threads(threads)


def _report_inherited(rank):
    print(f'printed by rank {rank}', flush=True)
    return os.environ.get('COLOSSAL_LITE_TEST_VALUE'), os.getcwd(), torch.get_num_threads()


def test_a_rank_gets_the_callers_environment_directory_and_output(tmp_path, monkeypatch,
                                                                   capfd):
    monkeypatch.setenv('COLOSSAL_LITE_TEST_VALUE', 'set after the server started')
    monkeypatch.chdir(tmp_path)
    got = run_ranks(_report_inherited, 2, {})
    assert got == [('set after the server started', str(tmp_path), 1)] * 2
    out = capfd.readouterr().out
    assert 'printed by rank 0' in out and 'printed by rank 1' in out


def test_a_local_function_is_refused_before_any_process_starts():
    with pytest.raises(TypeError, match='module-level function'):
        run_ranks(lambda rank: rank, 2, {})


def _rank_one_waits_forever(rank):
    if rank == 1:
        while True:
            time.sleep(0.1)
    torch.distributed.barrier()


def test_a_hang_fails_at_the_timeout_with_every_ranks_stacks():
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(_rank_one_waits_forever, 2, {}, timeout=5, collective_timeout=120)
    text = str(info.value)
    assert time.monotonic() - start < 30
    assert 'ranks [0, 1] of 2 did not finish within 5 s' in text
    rank0, rank1 = text.split('--- rank 0')[1].split('--- rank 1')
    assert 'in barrier' in rank0 and '_rank_one_waits_forever' in rank0, text
    assert 'in _rank_one_waits_forever' in rank1 and 'barrier' not in rank1, text


def _rank_one_is_killed(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.barrier()


def test_a_rank_killed_by_a_signal_is_named_first():
    with pytest.raises(ChildFailed, match=r'^rank 1 of 3 was killed by SIGKILL'):
        run_ranks(_rank_one_is_killed, 3, {}, timeout=60, collective_timeout=20)


def _nothing(*args):
    return None


def _all_reduce_rank(rank):
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t)
    return t.item()


def _launch_from_this_process(ranks_runs: int, workers: bool) -> None:
    """Commands' workers (``run_workers``, if ``workers``) and ``ranks_runs`` times launched
    ranks (``run_ranks``) from this process, each after a 2-thread op here (this process runs
    an OpenMP team and whatever threads earlier tests left)."""
    torch.set_num_threads(2)
    if workers:
        torch.randn(1 << 21).exp_()
        assert run_workers(2, free_port(), _nothing) == 0
    for _ in range(ranks_runs):
        torch.randn(1 << 21).exp_()
        assert run_ranks(_all_reduce_rank, 4, {}, timeout=60) == [6.0] * 4


def test_launches_from_a_threaded_process_back_to_back_do_not_hang():
    threads = torch.get_num_threads()
    try:
        _launch_from_this_process(3, workers=True)
    finally:
        torch.set_num_threads(threads)


# 3 in the suite (about 30 s); COLOSSAL_LITE_BACK_TO_BACK=50 is the check (7 minutes)
BACK_TO_BACK = int(os.environ.get('COLOSSAL_LITE_BACK_TO_BACK', '3') or 3)


@pytest.mark.timeout(0 if BACK_TO_BACK > 3 else 240)
def test_the_cli_test_back_to_back_does_not_hang(tmp_path):
    """The dp=2 x tp=2 ``colossal-lite train`` test, ``COLOSSAL_LITE_BACK_TO_BACK`` times in
    this process, each followed by launches from this process: every run passes; a hang
    fails at its first occurrence with every process's stacks."""
    from tests.test_cli import _check_dp2_tp2_run, _serial_losses
    serial = _serial_losses(4)
    threads = torch.get_num_threads()
    try:
        for i in range(BACK_TO_BACK):
            (tmp_path / str(i)).mkdir()
            _check_dp2_tp2_run(tmp_path / str(i), serial)
            _launch_from_this_process(1, workers=False)
    finally:
        torch.set_num_threads(threads)
