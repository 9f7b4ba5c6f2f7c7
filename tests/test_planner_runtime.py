"""A plan whose per-layer choices differ from the uniform ones (the BMW pipeline cut and the
DP's per-block checkpoint set) is written into its config, passes the CLI's parent checks
(``load_config`` + ``job.check_layout``) and trains like the serial job."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from colossal_lite.auto import plan
from colossal_lite.auto.cluster import ClusterProfile
from colossal_lite.auto.cost import stage_ranges
from colossal_lite.auto.model_spec import model_shape
from colossal_lite.config import load_config
from colossal_lite.testing import run_distributed

MODEL = dict(hidden=128, layers=8, vocab_size=8192, max_positions=64)


def _slow_link_profile() -> ClusterProfile:
    """4 devices, one per node, joined by a 100 MB/s link: gradient all-reduces cost more
    than a pipeline's activations, so the planner pipelines a GPT of 8 blocks."""
    from colossal_lite.auto import cluster
    path = os.path.join(os.path.dirname(cluster.__file__), 'profiles', 'nodes4x8.json')
    data = json.load(open(path))
    data.update(name='slow4', devices=4, devices_per_node=1)
    data['links'] = dict(data['links'], inter=dict(launch_s=1.5e-5, latency_s=1e-5,
                                                   bandwidth_Bps=1e8))
    return ClusterProfile.from_json(data)


@pytest.fixture(scope='module')
def planned():
    # 27 MiB per device: the pipelined plan fits only with some blocks recomputed
    return plan('gpt:tiny', devices=4, memory_gb=27 / 1024, cluster=_slow_link_profile(),
                batch=8, seq=64, **MODEL)


def test_the_plan_carries_the_bmw_cut_and_the_per_block_checkpoint_set(planned):
    cand = planned.estimate.candidate
    pipe = planned.config['parallel']['pipeline']
    named = [len(r) for r in stage_ranges(model_shape('gpt', 'tiny', 64, **MODEL),
                                          cand.stages, cand.partition)]
    assert pipe['size'] == 4 and pipe['partition'] == planned.per_layer['partition'] != named
    assert sum(pipe['partition']) == 8 and cand.checkpoint
    picks = planned.config['model']['checkpoint']
    assert picks == planned.per_layer['checkpoint'] and 0 < len(picks) < 8
    assert 'replaces' in planned.per_layer['note'] and 'checkpoint' in planned.report()


def _train_job(rank, steps):
    from colossal_lite.context import global_context as gpc
    from colossal_lite.worker import train
    return train(gpc.settings, gpc.settings.job.with_steps(steps))['losses']


def test_the_plan_passes_the_parent_checks_and_trains_like_serial(planned, tmp_path):
    from colossal_lite import cli
    config = dict(planned.config, train=dict(planned.config['train'], log_every=1,
                                             eval_batches=1, run_dir=str(tmp_path / 'run')))
    path = tmp_path / 'planned.py'
    path.write_text(dataclasses.replace(planned, config=config).to_py())
    cfg, layout, spec = cli.check_job(str(path), 4, 2)   # load_config + check_layout + data
    assert (layout.pipeline, spec.options['checkpoint']) == (4, config['model']['checkpoint'])
    losses = run_distributed(_train_job, 4, cfg.to_dict(), 2, timeout=400)
    serial_cfg = dict(config, parallel=dict(data=1))
    serial_cfg['model'] = {k: v for k, v in config['model'].items() if k != 'checkpoint'}
    load_config(serial_cfg)
    (serial,) = run_distributed(_train_job, 1, serial_cfg, 2, timeout=400)
    assert len(serial) == 2
    for got in losses:
        assert got == pytest.approx(serial, rel=1e-5)
