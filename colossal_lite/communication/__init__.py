"""Every collective of the library, addressed by ParallelMode and counted.

Plain collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``,
``broadcast``, ``reduce``, ``all_to_all``, ``all_to_all_uneven``; ``async_op=True`` for a
:class:`Pending`), point-to-point (``send``, ``recv``, ``ring_exchange``),
autograd conjugate pairs (``copy_to``/``reduce_from``, ``split_to``/``gather_from``,
``all_gather_to``/``reduce_scatter_to``, ``all_to_all_to``, ``all_to_all_rows``), the
bucketed gradient sum of a parameter used on part of the tokens (``partial_grad_param``) and the byte
counter (``comm_profile``).
"""
from .collective import (Pending, all_gather, all_reduce, all_to_all, all_to_all_uneven,
                         barrier, broadcast, check_divisible, prefers_pairwise, reduce,
                         reduce_scatter, resolve, split)
from .deferred_grad import partial_grad_param
from .mappings import (all_gather_to, all_to_all_rows, all_to_all_to, copy_to, gather_from,
                       reduce_from, reduce_scatter_to, split_to)
from .p2p import recv, ring_exchange, send
from .profile import CommStats, comm_profile, ring_wire_bytes, total_stats

__all__ = ['Pending', 'all_gather', 'all_reduce', 'all_to_all', 'all_to_all_uneven',
           'all_to_all_rows', 'barrier', 'broadcast',
           'check_divisible', 'prefers_pairwise', 'reduce', 'reduce_scatter', 'resolve', 'split', 'all_gather_to',
           'all_to_all_to', 'copy_to', 'gather_from', 'reduce_from', 'reduce_scatter_to',
           'split_to', 'partial_grad_param', 'recv', 'ring_exchange', 'send', 'CommStats', 'comm_profile',
           'ring_wire_bytes', 'total_stats']
