"""Which node this is and where the nodes meet: ``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, ``--rdzv-id`` of ``train``, ``generate`` and ``eval``, resolved into one
:class:`Nodes` before anything starts (no I/O: the environment is an argument).

Each value comes from the first of: its flag; SLURM's variables (``SLURM_NNODES``,
``SLURM_NODEID``, ``SLURM_JOB_ID``, ``MASTER_ADDR`` or the first host of
``SLURM_JOB_NODELIST``, ``MASTER_PORT``) when the job runs under SLURM (``SLURM_NNODES`` is
set); the single-node default (one node, rank 0, ``127.0.0.1:--port``). ``MASTER_ADDR`` and
``MASTER_PORT`` are read only for more than one node, so a single-node run never meets a
stray endpoint. Every inconsistency is a :class:`~colossal_lite.config.ConfigError` naming
the flag (or variable) and its value.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from ..config import ConfigError

DEFAULT_PORT = 29400            # torchrun's c10d rendezvous port
DEFAULT_RDZV_ID = 'colossal-lite'   # the run id of a multi-node run that names none


@dataclass(frozen=True)
class Nodes:
    """The nodes of a run: ``nnodes`` agents meet at ``host:port`` under ``rdzv_id``; this one
    is ``node_rank`` (None: c10d's order, see ``rendezvous.py``); ``sources`` names the
    environment variables that gave a value."""

    nnodes: int = 1
    node_rank: Optional[int] = 0
    host: str = '127.0.0.1'
    port: int = 0                  # 0: a free one (one node only)
    rdzv_id: Optional[str] = None  # None: a fresh id per run (one node only)
    sources: Tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        host = f'[{self.host}]' if ':' in self.host else self.host
        return f'{host}:{self.port}'

    def world_size(self, nproc: int) -> int:
        return self.nnodes * nproc

    def describe(self) -> str:
        """``node R of N, rendezvous at HOST:PORT (id ID)`` and where values came from."""
        rank = ('node ? (c10d orders the nodes)' if self.node_rank is None
                else f'node {self.node_rank}')
        text = f'{rank} of {self.nnodes}, rendezvous at {self.endpoint} (id {self.rdzv_id})'
        return text + (f'; from {", ".join(self.sources)}' if self.sources else '')


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-node flags (module doc); every default None = "not given"."""
    group = parser.add_argument_group(
        'multi-node', 'one command per node, each starting --nproc processes; precedence: '
        'flags > SLURM variables > one node')
    group.add_argument('--nnodes', type=int, default=None, metavar='N',
                       help='nodes of the run (default: SLURM_NNODES, else 1)')
    group.add_argument('--node-rank', type=int, default=None, metavar='R',
                       help='this node, 0..N-1: it holds ranks R*nproc..R*nproc+nproc-1 '
                            '(default: SLURM_NODEID, else 0 on one node)')
    group.add_argument('--rdzv-endpoint', default=None, metavar='HOST:PORT',
                       help="node 0's address and a free port there, the same on every node "
                            '(default: MASTER_ADDR or the first SLURM host, MASTER_PORT or '
                            f'{DEFAULT_PORT})')
    group.add_argument('--rdzv-id', default=None, metavar='ID',
                       help='the run id every node gives (default: SLURM_JOB_ID, else '
                            f'{DEFAULT_RDZV_ID!r})')


def nodes_from_args(args, env: Optional[Mapping[str, str]] = None) -> Nodes:
    """:func:`resolve_nodes` of a parsed command line (flags it lacks count as not given)."""
    return resolve_nodes(getattr(args, 'nnodes', None), getattr(args, 'node_rank', None),
                         getattr(args, 'rdzv_endpoint', None), getattr(args, 'rdzv_id', None),
                         getattr(args, 'port', 0) or 0, env)


def resolve_nodes(nnodes: Optional[int] = None, node_rank: Optional[int] = None,
                  endpoint: Optional[str] = None, rdzv_id: Optional[str] = None, port: int = 0,
                  env: Optional[Mapping[str, str]] = None) -> Nodes:
    """The :class:`Nodes` of the flags (None: not given) over ``env`` (default
    ``os.environ``): module doc. A ConfigError names the flag or variable and its value."""
    env = os.environ if env is None else env
    slurm = 'SLURM_NNODES' in env
    used = []

    def from_env(name):
        used.append(f'{name}={env[name]}')
        return env[name]

    _check_port(port, '--port')
    if nnodes is not None:
        count, count_name = _positive(nnodes, '--nnodes'), f'--nnodes {nnodes}'
    elif slurm:
        count, count_name = _positive(from_env('SLURM_NNODES'), 'SLURM_NNODES'), \
            f'SLURM_NNODES={env["SLURM_NNODES"]}'
    else:
        count, count_name = 1, '--nnodes 1 (the default)'

    if node_rank is not None:
        rank, rank_name = _integer(node_rank, '--node-rank'), f'--node-rank {node_rank}'
    elif count > 1 and slurm and 'SLURM_NODEID' in env:
        rank, rank_name = _integer(from_env('SLURM_NODEID'), 'SLURM_NODEID'), \
            f'SLURM_NODEID={env["SLURM_NODEID"]}'
    else:
        rank, rank_name = (0 if count == 1 else None), ''
    if rank is not None and not 0 <= rank < count:
        raise ConfigError(f'{rank_name} is outside [0, {count}) for {count_name}: node ranks '
                          f'run from 0 to nnodes - 1')

    if endpoint is not None:
        if port:
            raise ConfigError(f'--port {port} and --rdzv-endpoint {endpoint} both name the '
                              f'rendezvous port: give the port in --rdzv-endpoint only')
        host, at = parse_endpoint(endpoint, '--rdzv-endpoint')
    elif count > 1:
        host, at = _endpoint_from_env(env, slurm, from_env, count_name, port)
    else:
        host, at = '127.0.0.1', port

    if rdzv_id is not None:
        if not str(rdzv_id).strip():
            raise ConfigError(f'--rdzv-id must be a non-empty string, got {rdzv_id!r}')
        run_id = str(rdzv_id)
    elif count > 1:
        run_id = from_env('SLURM_JOB_ID') if slurm and env.get('SLURM_JOB_ID') else DEFAULT_RDZV_ID
    else:
        run_id = None
    if count > 1 and slurm:
        _check_one_task_per_node(env)
    return Nodes(count, rank, host, at, run_id, tuple(used))


def _endpoint_from_env(env, slurm, from_env, count_name, port) -> Tuple[str, int]:
    """``MASTER_ADDR`` or the first SLURM host, and ``--port``, ``MASTER_PORT`` or the default."""
    if env.get('MASTER_ADDR'):
        host = from_env('MASTER_ADDR')
    elif slurm and env.get('SLURM_JOB_NODELIST'):
        host = first_host(from_env('SLURM_JOB_NODELIST'))
    else:
        raise ConfigError(f'{count_name} needs --rdzv-endpoint HOST:PORT (node 0\'s address and a '
                          f'free port there, the same on every node), or MASTER_ADDR / SLURM\'s '
                          f'SLURM_JOB_NODELIST in the environment')
    if port:
        return host, port
    if env.get('MASTER_PORT'):
        return host, _check_port(_integer(from_env('MASTER_PORT'), 'MASTER_PORT'), 'MASTER_PORT',
                                 zero=False)
    return host, DEFAULT_PORT


def parse_endpoint(text: str, name: str = '--rdzv-endpoint') -> Tuple[str, int]:
    """``HOST:PORT`` (``[v6 address]:PORT`` too) -> ``(host, port)``; a ConfigError naming
    ``name`` and the text otherwise."""
    form = f'{name} must be HOST:PORT (e.g. node0:{DEFAULT_PORT} or [fe80::1]:{DEFAULT_PORT})'
    text = str(text).strip()
    if text.startswith('['):
        host, close, rest = text[1:].partition(']')
        if not close or not rest.startswith(':'):
            raise ConfigError(f'{form}, got {text!r}')
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(':')
        if not colon:
            raise ConfigError(f'{form}, got {text!r}: no port')
        if ':' in host:
            raise ConfigError(f'{form}, got {text!r}: put an IPv6 address in brackets')
    if not host:
        raise ConfigError(f'{form}, got {text!r}: no host')
    if not port_text.isdigit():
        raise ConfigError(f'{form}, got {text!r}: the port {port_text!r} is not a number')
    return host, _check_port(int(port_text), f'{name} {text}', zero=False)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``,
    ``rack[1-2]-n[01-04]`` -> ``rack1-n01`` (each bracket's first value, padding kept)."""
    text = str(nodelist).strip()
    depth, end = 0, len(text)
    for i, ch in enumerate(text):
        depth += (ch == '[') - (ch == ']')
        if ch == ',' and depth == 0:
            end = i
            break
    item, out = text[:end], ''
    while '[' in item:
        head, _, rest = item.partition('[')
        inside, close, item = rest.partition(']')
        if not close:
            raise ConfigError(f'SLURM_JOB_NODELIST={nodelist!r} has an unclosed bracket')
        out += head + inside.split(',')[0].split('-')[0]
    out += item
    if not out:
        raise ConfigError(f'SLURM_JOB_NODELIST={nodelist!r} names no host')
    return out


def _check_one_task_per_node(env) -> None:
    tasks, nodes = env.get('SLURM_STEP_NUM_TASKS'), env.get('SLURM_STEP_NUM_NODES')
    if tasks and nodes and tasks.isdigit() and nodes.isdigit() and int(tasks) > int(nodes):
        raise ConfigError(f'SLURM started SLURM_STEP_NUM_TASKS={tasks} tasks on '
                          f'SLURM_STEP_NUM_NODES={nodes} nodes: run one colossal-lite per node '
                          f'(srun --ntasks-per-node=1); it starts --nproc processes itself')


def _integer(value, name: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f'{name} must be an integer, got {value!r}')
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f'{name} must be an integer, got {value!r}') from None


def _positive(value, name: str) -> int:
    number = _integer(value, name)
    if number < 1:
        raise ConfigError(f'{name} must be a positive integer, got {value!r}')
    return number


def _check_port(port: int, name: str, zero: bool = True) -> int:
    low = 0 if zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ConfigError(f'{name}: the port must be in [{low}, 65535], got {port!r}')
    return port
