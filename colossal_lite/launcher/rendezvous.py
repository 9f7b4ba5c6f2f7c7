"""The rendezvous of the commands' agents: torch's c10d dynamic rendezvous (what ``torchrun
--rdzv-backend c10d`` uses) behind a thin handler, registered with torch's elastic registry as
:data:`BACKEND`, that adds two things each round:

* **Node order.** c10d numbers the agents by sorting (host name, pid), and the elastic
  agent gives the agent numbered g the global ranks g*K .. g*K+K-1 (K processes each). When
  every node names its ``--node-rank`` (or ``SLURM_NODEID``), this handler renumbers the
  agents by it, so node R holds ranks R*K .. R*K+K-1 in every round, restarts included.
  When no node names one, c10d's order stands. A mix, two nodes naming the same rank, or
  nodes giving different ``--nproc`` or ``--nnodes`` fail the rendezvous on every node,
  naming them.
* **One attempt number.** A node's agent counts its own restarts (``TORCHELASTIC_RESTART_COUNT``),
  but a node whose workers were healthy when another node failed restarts them without
  counting it. The handler agrees on ``max(rounds joined) - 1`` over the nodes and exports
  it as :data:`ATTEMPT_ENV` to the workers it starts (spawned children inherit the agent's
  environment), so every rank of a restarted group agrees that it is one
  (``run_state.restart_count``).

The exchange is one key per node in the round's store (``colossal_lite/node/<rank>``, a
JSON record) read by every node. Without the agent's shared store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, set with restarts) rank 0's worker hosts the
workers' store, so its address is rebuilt for the renumbered rank 0.
"""
from __future__ import annotations

import json
import os
import socket
from typing import List, Optional

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (RendezvousError, RendezvousHandler,
                                                  RendezvousInfo, RendezvousParameters,
                                                  RendezvousStoreInfo,
                                                  rendezvous_handler_registry)

BACKEND = 'colossal-lite-c10d'
ATTEMPT_ENV = 'COLOSSAL_LITE_ATTEMPT'   # the restart count every node agreed on
_KEY = 'colossal_lite/node/'


class NodeOrderedRendezvous(RendezvousHandler):
    """c10d's handler ``inner`` with the agents renumbered by ``node_rank`` (module doc)."""

    def __init__(self, inner: RendezvousHandler, node_rank: Optional[int], nproc: int,
                 nnodes: int, local_addr: Optional[str] = None):
        self._inner, self._node_rank, self._nproc = inner, node_rank, nproc
        self._nnodes, self._local_addr = nnodes, local_addr
        self._rounds = 0

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        self._rounds += 1
        store, world = info.store, info.world_size
        store.set(f'{_KEY}{info.rank}', json.dumps(dict(
            node_rank=self._node_rank, nproc=self._nproc, nnodes=self._nnodes,
            rounds=self._rounds,
            host=socket.gethostname(), pid=os.getpid())))
        peers = [json.loads(store.get(f'{_KEY}{r}')) for r in range(world)]
        rank = node_order(peers)[info.rank]
        os.environ[ATTEMPT_ENV] = str(max(p['rounds'] for p in peers) - 1)
        bootstrap = info.bootstrap_store_info
        if not self._inner.use_agent_store:   # rank 0's worker hosts the store: rank 0's address
            bootstrap = RendezvousStoreInfo.build(rank, PrefixStore('colossal_lite/', store),
                                                  self._local_addr)
        return RendezvousInfo(store, rank, world, bootstrap)

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self):
        return self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def node_order(peers: List[dict]) -> List[int]:
    """The new rank of each agent (by c10d's rank) from the records every agent published:
    its declared ``node_rank`` (all None: c10d's order); a RendezvousError on a mix, a
    duplicate, or differing ``--nproc`` or ``--nnodes``."""
    where = [f"{p['host']} (pid {p['pid']})" for p in peers]
    for key, what in (('nproc', 'start the same number of processes'),
                      ('nnodes', 'give the same number of nodes')):
        if len({p[key] for p in peers}) > 1:
            runs = ', '.join(f"{w}: --{key} {p[key]}" for w, p in zip(where, peers))
            raise RendezvousError(f'every node must {what}; {runs}')
    declared = [p['node_rank'] for p in peers]
    if all(d is None for d in declared):
        return list(range(len(peers)))
    if any(d is None for d in declared):
        missing = ', '.join(w for w, d in zip(where, declared) if d is None)
        raise RendezvousError(f'give --node-rank on every node or on none; not given on {missing}')
    for rank in sorted(set(declared)):
        same = [w for w, d in zip(where, declared) if d == rank]
        if len(same) > 1:
            raise RendezvousError(f'--node-rank {rank} was given on {len(same)} nodes: '
                                  f'{", ".join(same)}')
    if sorted(declared) != list(range(len(peers))):
        raise RendezvousError(f'{len(peers)} nodes met with --node-rank {sorted(declared)}: '
                              f'node ranks run from 0 to {len(peers) - 1}')
    return declared


def _create(params: RendezvousParameters) -> RendezvousHandler:
    config = dict(params.config)
    node_rank, nproc = config.pop('node_rank', None), int(config.pop('nproc'))
    inner = rendezvous_handler_registry.create_handler(RendezvousParameters(
        'c10d', params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
        params.local_addr, **config))
    return NodeOrderedRendezvous(inner, None if node_rank is None else int(node_rank), nproc,
                                 params.max_nodes, params.local_addr)


def register() -> None:
    """Make :data:`BACKEND` known to torch's rendezvous registry (again: a no-op)."""
    rendezvous_handler_registry.register(BACKEND, _create)


def rdzv_configs(nodes, nproc: int) -> dict:
    """The ``LaunchConfig.rdzv_configs`` of a run on ``nodes``: the node rank and process
    count the handler exchanges, and which agent hosts c10d's store (node 0, the endpoint's
    host) when node ranks are known on several nodes; else c10d decides (the agent whose
    host name matches the endpoint)."""
    configs = dict(nproc=nproc)
    if nodes.node_rank is not None:
        configs['node_rank'] = nodes.node_rank
        if nodes.nnodes > 1:
            configs['is_host'] = nodes.node_rank == 0
    return configs
