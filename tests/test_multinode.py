"""Multi-node `colossal-lite train`, `generate`, `eval` (docs/cli_and_data.md, "Multi-node"):
the node flags and SLURM's variables resolved and checked before anything starts; the agents
renumbered by --node-rank in torch's c10d rendezvous; and two agents on this machine as two
nodes of 2 processes each, which form one group of 4 that prints the single-node run's losses
bit for bit and, with --max-restarts 1 and a worker of node 1 killed after a checkpoint,
restart on both nodes and end with the uninterrupted run's losses and parameters."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from colossal_lite import cli
from colossal_lite.config import ConfigError
from colossal_lite.launcher import free_port
from colossal_lite.launcher.nodes import Nodes, first_host, resolve_nodes
from tests.test_cli import REPO, TINY, _process_tree, _write

# the main job's dp=2 x tp=2 config, 8 steps of 16 sequences of 128 tokens, saved at step 4
JOB = (f"_base_ = {os.path.join(REPO, 'configs', 'gpt_dp2_tp2.py')!r}\n"
       "train = dict(global_batch_size=16, steps=8, log_every=1, eval_batches=1)\n"
       "checkpoint = dict(path='ckpt', interval=4)\n")
SLURM = ('SLURM_NNODES', 'SLURM_NODEID', 'SLURM_JOB_ID', 'SLURM_JOB_NODELIST', 'MASTER_ADDR',
         'MASTER_PORT', 'SLURM_STEP_NUM_TASKS', 'SLURM_STEP_NUM_NODES')


@pytest.fixture
def no_slurm(monkeypatch):
    for name in SLURM:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------ flags, SLURM, checks
def test_flags_win_over_slurm_which_wins_over_one_node():
    slurm = dict(SLURM_NNODES='4', SLURM_NODEID='2', SLURM_JOB_ID='77',
                 SLURM_JOB_NODELIST='gpu[03-06],cpu1')
    assert resolve_nodes(env={}) == Nodes(1, 0, '127.0.0.1', 0, None)
    assert resolve_nodes(port=1234, env=dict(MASTER_ADDR='m', MASTER_PORT='9')) == \
        Nodes(1, 0, '127.0.0.1', 1234, None)                      # one node: no stray endpoint
    got = resolve_nodes(env=slurm)
    assert (got.nnodes, got.node_rank, got.endpoint, got.rdzv_id) == (4, 2, 'gpu03:29400', '77')
    assert got.sources == ('SLURM_NNODES=4', 'SLURM_NODEID=2',
                           'SLURM_JOB_NODELIST=gpu[03-06],cpu1', 'SLURM_JOB_ID=77')
    got = resolve_nodes(env=dict(slurm, MASTER_ADDR='head', MASTER_PORT='2345'))
    assert got.endpoint == 'head:2345'
    got = resolve_nodes(3, 0, '10.0.0.1:5000', 'mine', env=dict(slurm, MASTER_ADDR='head'))
    assert (got.nnodes, got.node_rank, got.endpoint, got.rdzv_id, got.sources) == \
        (3, 0, '10.0.0.1:5000', 'mine', ())
    got = resolve_nodes(2, env={'MASTER_ADDR': 'head'})          # no node rank: c10d's order
    assert (got.node_rank, got.endpoint, got.rdzv_id) == (None, 'head:29400', 'colossal-lite')
    assert resolve_nodes(2, 1, '[fe80::1]:29400', env={}).endpoint == '[fe80::1]:29400'


@pytest.mark.parametrize('nodelist, first', [
    ('node7', 'node7'), ('node[01-04,07]', 'node01'), ('gpu-a[3,5-6]-ib,cpu1', 'gpu-a3-ib'),
    ('rack[1-2]-n[01-04]', 'rack1-n01'), ('a1,b[2-3]', 'a1')])
def test_the_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize('args, env, message', [
    ((2, 2, 'h:1'), {}, r'--node-rank 2 is outside \[0, 2\) for --nnodes 2'),
    ((2, -1, 'h:1'), {}, r'--node-rank -1 is outside \[0, 2\)'),
    ((1, 1), {}, r'--node-rank 1 is outside \[0, 1\) for --nnodes 1'),
    ((None,), dict(SLURM_NNODES='2', SLURM_NODEID='5', MASTER_ADDR='a'),
     r'SLURM_NODEID=5 is outside \[0, 2\) for SLURM_NNODES=2'),
    ((0,), {}, '--nnodes must be a positive integer, got 0'),
    ((None,), dict(SLURM_NNODES='two'), "SLURM_NNODES must be an integer, got 'two'"),
    ((2, 0), {}, '--nnodes 2 needs --rdzv-endpoint HOST:PORT'),
    ((2, 0, 'node0'), {}, "--rdzv-endpoint must be HOST:PORT .*got 'node0': no port"),
    ((2, 0, 'node0:x'), {}, "got 'node0:x': the port 'x' is not a number"),
    ((2, 0, ':29400'), {}, "got ':29400': no host"),
    ((2, 0, 'fe80::1:29400'), {}, 'put an IPv6 address in brackets'),
    ((2, 0, 'node0:70000'), {}, r'--rdzv-endpoint node0:70000: the port must be in \[1, 65535\]'),
    ((2, 0, None, None), dict(MASTER_ADDR='a', MASTER_PORT='0'), 'MASTER_PORT: the port must'),
    ((2, 0, 'h:1', ''), {}, "--rdzv-id must be a non-empty string, got ''"),
    ((None,), dict(SLURM_NNODES='2', SLURM_NODEID='0', SLURM_JOB_NODELIST='a[1-2]',
                   SLURM_STEP_NUM_TASKS='16', SLURM_STEP_NUM_NODES='2'),
     'SLURM started SLURM_STEP_NUM_TASKS=16 tasks on SLURM_STEP_NUM_NODES=2 nodes: run one'),
])
def test_a_bad_node_setting_names_the_flag_and_the_value(args, env, message):
    with pytest.raises(ConfigError, match=message):
        resolve_nodes(*args, env=env)


def _must_not_start(*args, **kwargs):
    raise AssertionError('a worker was started')


@pytest.mark.parametrize('flags, message', [
    (['--nnodes', '2', '--node-rank', '2', '--rdzv-endpoint', '127.0.0.1:29400'],
     r'--node-rank 2 is outside \[0, 2\) for --nnodes 2'),
    (['--nnodes', '2', '--node-rank', '0'], '--nnodes 2 needs --rdzv-endpoint HOST:PORT'),
    (['--nnodes', '2', '--node-rank', '0', '--rdzv-endpoint', 'node0'], "got 'node0': no port"),
    (['--nnodes', '2', '--node-rank', '0', '--rdzv-endpoint', 'h:1', '--port', '5'],
     '--port 5 and --rdzv-endpoint h:1 both name the rendezvous port'),
])
def test_train_generate_and_eval_stop_before_anything_starts(tmp_path, monkeypatch, capsys,
                                                            no_slurm, flags, message):
    from colossal_lite.commands import eval as eval_command, generate
    monkeypatch.setattr(cli, 'run_workers', _must_not_start)
    monkeypatch.setattr(generate, 'run_workers', _must_not_start)
    monkeypatch.setattr(eval_command, 'run_workers', _must_not_start)
    job = _write(tmp_path, TINY)
    for argv in (['train', job, '--nproc', '2'],
                 ['generate', str(tmp_path), '--prompt', 'A', '--tokens', '1'],
                 ['eval', str(tmp_path)]):
        capsys.readouterr()
        assert cli.main(argv + flags) == 2, argv
        assert re.search(message, capsys.readouterr().err), argv


def test_a_world_that_does_not_fit_suggests_the_nproc_per_node(tmp_path):
    with pytest.raises(ConfigError, match=r'got world size 2 \(--nnodes 2 x --nproc 1\): run '
                                          r'with --nproc 2 \(a world size of 4\)'):
        cli.check_job(_write(tmp_path, TINY.replace('size=2', 'size=4')), 1, None, nnodes=2)


def test_the_commands_hand_the_nodes_to_the_launcher(tmp_path, monkeypatch, no_slurm):
    """train: the layout checked for nnodes x nproc, nproc workers on this node; generate and
    eval: the tensor-parallel size is nnodes x nproc; SLURM fills what the flags leave."""
    from colossal_lite.commands import eval as eval_command
    calls = []
    record = lambda nproc, port, entry, *args, nodes=None, **kw: calls.append((nproc, args, nodes))
    monkeypatch.setattr(cli, 'run_workers', record)
    monkeypatch.setattr(eval_command, 'run_workers', record)
    monkeypatch.setattr(eval_command, 'prepare', lambda args: calls.append(args.nproc))
    job = _write(tmp_path, TINY)     # tensor 2: dp = 4 / 2 on 2 nodes of 2
    flags = ['--nnodes', '2', '--node-rank', '1', '--rdzv-endpoint', 'node0:29500',
             '--rdzv-id', 'j']
    assert cli.main(['train', job, '--nproc', '2'] + flags) is None
    assert calls.pop() == (2, (job, None), Nodes(2, 1, 'node0', 29500, 'j'))
    assert cli.main(['eval', str(tmp_path), '--nproc', '3'] + flags) is None
    (nproc, args, nodes), world = calls.pop(), calls.pop()
    assert (world, nproc, args[1], nodes) == (6, 3, 6, Nodes(2, 1, 'node0', 29500, 'j'))
    monkeypatch.setenv('SLURM_NNODES', '2')
    monkeypatch.setenv('SLURM_NODEID', '1')
    monkeypatch.setenv('SLURM_JOB_ID', '42')
    monkeypatch.setenv('SLURM_JOB_NODELIST', 'n[07-08]')
    monkeypatch.setenv('MASTER_PORT', '2345')
    assert cli.main(['train', job, '--nproc', '2']) is None
    nodes = calls.pop()[2]
    assert (nodes.nnodes, nodes.node_rank, nodes.endpoint, nodes.rdzv_id) == \
        (2, 1, 'n07:2345', '42')
    assert cli.main(['train', job, '--nproc', '2', '--node-rank', '0', '--rdzv-id', 'x']) is None
    nodes = calls.pop()[2]
    assert (nodes.nnodes, nodes.node_rank, nodes.endpoint, nodes.rdzv_id) == \
        (2, 0, 'n07:2345', 'x')


# ------------------------------------------------------------ the rendezvous handler
class _FakeC10d:
    """What c10d's handler returns to one agent: its rank (sorted by host and pid), one store."""

    def __init__(self, store, rank, world, shared=True):
        from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
        self.info = RendezvousInfo(store, rank, world, RendezvousStoreInfo('c10d-rank-0', 1))
        self.use_agent_store = shared

    def next_rendezvous(self):
        return self.info


def _meet(node_ranks, nprocs=None, shared=True, rounds=None, nnodes=None):
    """Every agent's next_rendezvous at once (threads) over one store: (rank, master) or the
    error of each, by c10d rank."""
    from colossal_lite.launcher.rendezvous import NodeOrderedRendezvous
    store = torch.distributed.HashStore()
    world = len(node_ranks)
    handlers = [NodeOrderedRendezvous(_FakeC10d(store, r, world, shared), node_ranks[r],
                                      (nprocs or [2] * world)[r], (nnodes or [world] * world)[r],
                                      local_addr=f'host{r}')
                for r in range(world)]
    for handler, extra in zip(handlers, rounds or [0] * world):
        handler._rounds = extra
    out = [None] * world

    def join(r):
        try:
            info = handlers[r].next_rendezvous()
            out[r] = (info.rank, info.bootstrap_store_info.master_addr)
        except Exception as err:  # noqa: BLE001 -- reported to the test
            out[r] = err
    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_the_agents_are_renumbered_by_their_node_rank(monkeypatch):
    from colossal_lite.launcher.rendezvous import ATTEMPT_ENV
    monkeypatch.setenv(ATTEMPT_ENV, '0')   # the handler sets it in this process: undone after
    assert _meet([2, 0, 1]) == [(2, 'c10d-rank-0'), (0, 'c10d-rank-0'), (1, 'c10d-rank-0')]
    assert _meet([None, None]) == [(0, 'c10d-rank-0'), (1, 'c10d-rank-0')]   # c10d's order
    # without the agents' shared store rank 0's worker hosts it: the new rank 0's address
    assert _meet([1, 0], shared=False) == [(1, 'host1'), (0, 'host1')]
    # a node that restarted because another failed agrees on the restart count
    _meet([0, 1], rounds=[0, 1])
    assert os.environ[ATTEMPT_ENV] == '1'


@pytest.mark.parametrize('node_ranks, nprocs, nnodes, message', [
    ([0, 0], None, None, r'--node-rank 0 was given on 2 nodes: .* \(pid \d+\), .*'),
    ([0, None], None, None, 'give --node-rank on every node or on none; not given on'),
    ([0, 1], [2, 3], None, 'every node must start the same number of processes; .*: --nproc 2, '
                           '.*: --nproc 3'),
    ([0, 1], None, [2, 3], 'every node must give the same number of nodes; .*: --nnodes 2, '
                           '.*: --nnodes 3'),
    ([0, 2], None, None, r'2 nodes met with --node-rank \[0, 2\]: node ranks run from 0 to 1'),
])
def test_nodes_that_disagree_fail_the_rendezvous_on_every_node(node_ranks, nprocs, nnodes,
                                                               message):
    from torch.distributed.elastic.rendezvous import RendezvousError
    for got in _meet(node_ranks, nprocs, nnodes=nnodes):
        assert isinstance(got, RendezvousError) and re.search(message, str(got)), got


# ------------------------------------------------------------ two agents on this machine
def _start(argv, cwd, env):
    return subprocess.Popen([sys.executable, '-m', 'colossal_lite.cli'] + argv, cwd=str(cwd),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_all(procs, cwd, timeout):
    """Each process's CompletedProcess; past ``timeout`` s every process under them prints
    its stacks (SIGUSR1), all are killed and the test fails with what they printed."""
    deadline, done = time.monotonic() + timeout, []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        except subprocess.TimeoutExpired:
            trees = [pid for p in procs for pid in _process_tree(p.pid)]
            for sig, pause in ((signal.SIGUSR1, 3), (signal.SIGKILL, 0)):
                for pid in trees:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                time.sleep(pause)
            report = '\n'.join(f'--- {p.args[3:]}\n' + '\n'.join(p.communicate())
                               for p in procs if p.returncode is None or p is proc)
            (cwd / 'hang.txt').write_text(report)
            pytest.fail(f'hung after {timeout} s:\n{report}', pytrace=False)
    return done


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in SLURM}
    return dict(env, PYTHONPATH=REPO, OMP_NUM_THREADS='1', **extra)


def _train_on_two_nodes(cwd, extra=(), node1_env=None, timeout=240):
    """``colossal-lite train JOB --nproc 2`` as node 1, then as node 0, on this machine: node 1
    starts first, so c10d (host, pid order) numbers it 0 and only --node-rank puts it second."""
    (cwd / 'job.py').write_text(JOB)
    flags = ['--nnodes', '2', '--rdzv-endpoint', f'127.0.0.1:{free_port()}',
             '--rdzv-id', cwd.name] + list(extra)
    node1 = _start(['train', 'job.py', '--nproc', '2', '--node-rank', '1'] + flags, cwd,
                   _env(**(node1_env or {})))
    node0 = _start(['train', 'job.py', '--nproc', '2', '--node-rank', '0'] + flags, cwd, _env())
    return _wait_all([node0, node1], cwd, timeout)


def _records(cwd, stdout):
    written = re.search(r'^wrote (\S+metrics\.jsonl)', stdout, re.M).group(1)
    return [json.loads(line) for line in open(os.path.join(cwd, written))]


def _losses(records):
    return [(r['step'], r['loss']) for r in records if 'loss' in r]


def _loss_lines(stdout):
    return re.findall(r'^step=\d+ epoch=0 loss=\S+', stdout, re.M)


@pytest.fixture(scope='module')
def one_node(tmp_path_factory):
    """The job on one node of 4 processes: (stdout, metrics records, the saved tensors)."""
    from tests.test_resume import _saved
    cwd = tmp_path_factory.mktemp('one_node')
    (cwd / 'job.py').write_text(JOB)
    run, = _wait_all([_start(['train', 'job.py', '--nproc', '4'], cwd, _env())], cwd, 240)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout, _records(cwd, run.stdout), _saved(cwd / 'ckpt')


@pytest.mark.timeout(600)   # with the fixture's run; 2 min at load 13 on 2 cores
def test_two_nodes_of_two_form_one_group_of_four_with_the_single_node_losses(tmp_path, one_node):
    out, records, _ = one_node
    node0, node1 = _train_on_two_nodes(tmp_path)
    assert node0.returncode == 0 and node1.returncode == 0, \
        node0.stdout + node0.stderr + node1.stdout + node1.stderr
    assert 'world size 4 on 2 node(s) x 2 process(es): node R holds ranks R*2..R*2+1' \
        in node0.stdout
    assert 'node 0 of 2, rendezvous at 127.0.0.1:' in node0.stdout
    assert 'node 1 of 2, rendezvous at 127.0.0.1:' in node1.stdout
    assert 'world size 4 on 1 node(s) x 4 process(es)' in out
    assert len(_loss_lines(out)) == 8 and _loss_lines(node0.stdout) == _loss_lines(out)
    assert _loss_lines(node1.stdout) == []                        # rank 0 lives on node 0
    assert _losses(_records(tmp_path, node0.stdout)) == _losses(records)    # bit for bit


@pytest.mark.timeout(600)
def test_a_killed_worker_restarts_both_nodes_which_resume_to_the_same_end(tmp_path, one_node):
    """--max-restarts 1; global rank 3 SIGKILLs itself after step 6 of the first attempt --
    the variable is set on node 1 only, so this also shows that rank 3 lives there. Both
    agents restart, the group resumes from the step-4 checkpoint on the shared directory
    and ends with the uninterrupted run's losses and parameters, bit for bit."""
    from tests.test_resume import _saved
    _, records, saved = one_node
    node0, node1 = _train_on_two_nodes(tmp_path, ['--max-restarts', '1'],
                                       node1_env=dict(COLOSSAL_LITE_TEST_KILL='3:6'),
                                       timeout=400)
    assert node0.returncode == 0 and node1.returncode == 0, \
        node0.stdout + node0.stderr + node1.stdout + node1.stderr
    assert node0.stdout.count('world size 4 on 2 node(s)') == 2     # two attempts
    assert 'resumed from ckpt at step 4 (restart 1)' in node0.stdout
    got = _losses(_records(tmp_path, node0.stdout))
    assert [s for s, _ in got] == [5, 6, 7, 8]
    assert got == _losses(records)[4:]
    final = _saved(tmp_path / 'ckpt')
    assert set(final) == set(saved)
    for key, value in saved.items():
        assert torch.equal(final[key], value), key
