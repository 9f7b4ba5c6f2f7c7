"""A planned config, written as ``colossal-lite plan --write`` writes it, trained on its
ranks and serially (shared by the planner tests of each mode)."""
from __future__ import annotations

import dataclasses

import pytest

from colossal_lite.testing import run_distributed


def _train_job(rank, steps):
    from colossal_lite.context import global_context as gpc
    from colossal_lite.worker import train
    return train(gpc.settings, gpc.settings.job.with_steps(steps))['losses']


def assert_planned_config_trains_like_serial(planned, tmp_path, world: int = 4, steps: int = 2):
    """``planned.to_py()`` passes ``cli.check_job`` with the planned layout, and ``steps``
    training steps on ``world`` processes give the serial job's losses (rel 1e-5)."""
    from colossal_lite import cli
    config = dict(planned.config, train=dict(planned.config['train'], log_every=1,
                                             eval_batches=1, run_dir=str(tmp_path / 'run')))
    path = tmp_path / 'planned.py'
    path.write_text(dataclasses.replace(planned, config=config).to_py())
    cfg, layout, _ = cli.check_job(str(path), world, steps)
    assert layout == planned.estimate.candidate.layout
    losses = run_distributed(_train_job, world, cfg.to_dict(), steps, timeout=400)
    (serial,) = run_distributed(_train_job, 1, dict(config, parallel=dict(data=1)), steps,
                                timeout=400)
    assert len(serial) == steps
    for got in losses:
        assert got == pytest.approx(serial, rel=1e-5)
