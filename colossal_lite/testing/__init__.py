"""Test machinery: launched ranks, and the one serial-vs-parallel harness.

* ``distributed.py``: ``run_distributed(fn, world_size, config, *args)`` starts launched
  ranks (gloo, one thread each, timeouts) and returns their results.
* ``trace.py``: ``training_trace(model_or_engine, batch, ...)`` records per step the loss,
  the gathered outputs, every full gradient and the full parameters after the step.
* ``compare.py``: ``assert_matches_serial(rank_traces, serial_trace, tol)`` merges
  per-rank traces (replicas must agree) and names the first step and key that differ.

A layout test reads (the function the ranks run is a module-level one: it is pickled)::

    def rank_trace(rank, batch):
        return training_trace(build(), batch, loss_fn)

    serial = training_trace(build(), batch, loss_fn)                 # no launch
    assert_matches_serial(run_distributed(rank_trace, n, cfg, batch), serial)
"""
from .compare import (assert_close_dict, assert_matches_serial, max_rel_diff, merge_traces,
                      tolerance, trace_diffs)
from .distributed import ChildFailed, free_port, run_distributed
from .trace import (Trace, engine_step, full_gradients, full_outputs, make_optimizer,
                    plain_step, replica_batch, replica_mean, training_trace)

__all__ = ['ChildFailed', 'Trace', 'assert_close_dict', 'assert_matches_serial',
           'engine_step', 'free_port', 'full_gradients', 'full_outputs', 'make_optimizer',
           'max_rel_diff', 'merge_traces', 'plain_step', 'replica_batch', 'replica_mean',
           'run_distributed', 'tolerance', 'trace_diffs', 'training_trace']
