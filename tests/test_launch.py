"""launch(): errors before any group exists, the context's queries, and per-mode seeds."""
import os

import pytest
import torch

import colossal_lite as clt
from colossal_lite.context import ParallelMode as PM, global_context as gpc, seed
from colossal_lite.testing import free_port, run_distributed


def test_bad_world_size_fails_at_once_without_a_process_group():
    config = dict(parallel=dict(tensor=dict(size=4, mode='1d')))
    with pytest.raises(clt.ConfigError, match='got world size 6'):
        clt.launch(config, rank=0, world_size=6, host='127.0.0.1', port=free_port())
    assert not torch.distributed.is_initialized()


def test_missing_launcher_environment_is_named(monkeypatch):
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_PORT'):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match='environment variable RANK is not set'):
        clt.launch_from_torch(dict())
    with pytest.raises(RuntimeError, match='SLURM_PROCID'):
        clt.launch_from_slurm(dict(), host='127.0.0.1', port=1)


def _queries(rank):
    torch.manual_seed(7)  # the default stream stays shared after launch
    shared = torch.rand(3)
    with seed(PM.TENSOR):
        tensor_draw = torch.rand(3)
    with seed(PM.DATA):
        data_draw = torch.rand(3)
    return dict(
        sizes={m.name: gpc.get_world_size(m) for m in (PM.GLOBAL, PM.DATA, PM.TENSOR, PM.PIPELINE, PM.PARALLEL_1D)},
        local={m.name: gpc.get_local_rank(m) for m in (PM.DATA, PM.TENSOR)},
        ranks=gpc.get_ranks_in_group(PM.TENSOR), global_rank=gpc.get_global_rank(),
        initialized=(gpc.is_initialized(PM.PARALLEL_1D), gpc.is_initialized(PM.PARALLEL_2D_ROW)),
        shared=shared, tensor_draw=tensor_draw, data_draw=data_draw,
        device=str(gpc.device))


def test_context_queries_and_seed_streams():
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    results = run_distributed(_queries, 4, config, timeout=300)
    for rank, r in enumerate(results):
        assert r['global_rank'] == rank
        assert r['sizes'] == dict(GLOBAL=4, DATA=2, TENSOR=2, PIPELINE=1, PARALLEL_1D=2)
        assert r['local'] == dict(DATA=rank // 2, TENSOR=rank % 2)
        assert r['ranks'] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r['initialized'] == (True, False)
        assert r['device'] == 'cpu'
        assert torch.equal(r['shared'], results[0]['shared'])
    # TENSOR streams differ inside a tensor group and repeat across data replicas
    assert not torch.equal(results[0]['tensor_draw'], results[1]['tensor_draw'])
    assert torch.equal(results[0]['tensor_draw'], results[2]['tensor_draw'])
    # DATA streams differ across replicas and repeat inside a tensor group
    assert not torch.equal(results[0]['data_draw'], results[2]['data_draw'])
    assert torch.equal(results[0]['data_draw'], results[1]['data_draw'])


def _torchrun_child(rank, port, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE='2', LOCAL_RANK=str(rank),
                      MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        clt.launch_from_torch(dict(parallel=dict(tensor=dict(size=2, mode='1d')), timeout=60))
        queue.put((rank, gpc.get_world_size(PM.PARALLEL_1D), gpc.get_local_rank(PM.PARALLEL_1D)))
        gpc.destroy()
    except Exception as err:  # reported to the parent
        queue.put((rank, 'error', repr(err)))


def test_launch_from_torch_environment():
    from colossal_lite.launcher.start import rank_context
    ctx = rank_context()   # the launcher's start method for ranks (no fork of this process)
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_torchrun_child, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == [(0, 2, 0), (1, 2, 1)]


def _raise_on_rank_one(rank):
    if rank == 1:
        raise ValueError('rank one fails on purpose')
    torch.distributed.barrier()  # would hang forever without the harness's timeout
    return rank


def test_a_failing_rank_fails_the_run_instead_of_hanging():
    with pytest.raises(Exception, match='rank one fails on purpose'):
        run_distributed(_raise_on_rank_one, 2, dict(), timeout=120, collective_timeout=20)
