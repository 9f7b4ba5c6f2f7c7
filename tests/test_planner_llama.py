"""The planner costs Llama (grouped-query attention, SwiGLU, RMSNorm, rotary, no biases, a
tied or untied head) from its registry entry, as it costs GPT:

* parameters per rank equal a meta build of the presets tiny, llama3-1b (tied head) and
  llama3-8b, all with kv_heads < heads: serial, 1D t=2, 1D with the kv heads replicated
  (t=4 for tiny, t=16 for 8 kv heads), 2D, and a pipelined 1D layout;
* the activations a block saves (``block_values_per_token``) equal what autograd saves on
  real Llama blocks (serial, 1D split and replicated kv heads, 2D, sequence), and the
  tensor-parallel bytes of a block (``block_comm_bytes``) the byte counter;
* the peak memory of real steps (``test_planner_memory``'s harness and bands): ZeRO-3
  (exact), data parallel (exact) and 1D with the kv heads replicated (GPT's 1D band);
* ``colossal-lite plan --model llama3-8b --devices 64`` prints a plan, and the plan's
  layout obeys the kv-head rule;
* ``check_layout`` names ``model.kv_heads`` where the head split cannot take it (2D split 2
  with 3 kv heads; 1D t=3 with 2) and accepts 1D t=4 with 2 kv heads (replicated).
"""
import pytest
import torch

import model_zoo  # noqa: F401  (registers llama)
from colossal_lite.auto import load_profile, plan
from colossal_lite.auto.cost import Candidate, evaluate
from colossal_lite.auto.model_spec import kv_replicated, model_shape
from colossal_lite.auto.search import job_spec, layouts
from colossal_lite.communication import comm_profile
from colossal_lite.config import ConfigError, ParallelLayout, parse_parallel
from colossal_lite.job import check_layout
from colossal_lite.testing import run_distributed
from model_zoo import Llama
from tests.test_planner import _saved_bytes, check_rank_params
from tests.test_planner_memory import _l, check_peak_memory

OPTS = dict(vocab_size=256, max_positions=16, hidden=32, layers=2, heads=4, kv_heads=2,
            intermediate=48, dropout=0.0)


def _tensor(size, mode, pipeline=1):
    return (dict(pipeline=pipeline, tensor=dict(size=size, mode=mode)), size * pipeline)


# (parallel, world) per preset; tiny has 2 kv heads (1D t=4 replicates them), the others 8
# (1D t=16 replicates them)
_LAYOUTS = {'tiny': [({}, 1), _tensor(2, '1d'), _tensor(4, '1d'), _tensor(4, '2d'),
                     _tensor(2, '1d', pipeline=2)],
            'llama3-1b': [({}, 1), _tensor(2, '1d'), _tensor(16, '1d'), _tensor(4, '2d'),
                          _tensor(2, '1d', pipeline=2)],
            'llama3-8b': [({}, 1), _tensor(2, '1d'), _tensor(16, '1d'), _tensor(4, '2d')]}


@pytest.mark.parametrize('preset', sorted(_LAYOUTS))
def test_parameter_counts_equal_meta_build(preset):
    shape = model_shape('llama', preset, seq=64)
    assert shape.kv_heads < shape.heads
    assert shape.tied_head == (preset == 'llama3-1b')
    replicated = 0
    for parallel, world in _LAYOUTS[preset]:
        layout = parse_parallel(parallel).with_world_size(world)
        replicated += kv_replicated(layout.mode, layout.tensor, shape.kv_heads)
        for _ in check_rank_params(shape, layout, lambda: Llama.from_preset(preset)):
            pass
    assert replicated == 1   # one layout per preset replicates the kv heads


def _llama_saved_per_token(rank):
    """Saved values per token of one Llama block (batch 4 minus batch 2) on this rank."""
    torch.manual_seed(0)
    model = Llama(**OPTS)
    saved = []
    for b in (2, 4):
        ids = torch.randint(0, 256, (b, 16))
        saved.append(_saved_bytes(model, model.blocks['0'],
                                  lambda: model(ids).float().sum().backward()))
    return (saved[1] - saved[0]) / (2 * 16 * 4)


def _llama_block_bytes(rank, op):
    """Bytes (of ``op``; None: all) a block adds to a forward + backward (2 blocks minus 1)
    on this rank."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 16))
    out = []
    for layers in (1, 2):
        model = Llama(**dict(OPTS, layers=layers))
        model(ids).float().sum().backward()
        with comm_profile() as stats:
            model(ids).float().sum().backward()
        out.append(stats.bytes(op=op))
    return out[1] - out[0]


@pytest.mark.parametrize('mode,size', [(None, 1), ('1d', 2), ('1d', 4), ('2d', 4),
                                       ('sequence', 2)])
def test_block_activations_and_bytes_equal_real_blocks(mode, size):
    """Saved values per token and tensor bytes per block, per rank (1D t=4: the kv heads
    replicated, their weight gradients all-reduced; sequence: the bytes each rank sends,
    ``formulas.ring_attention_bytes`` of the k/v width)."""
    parallel = dict(tensor=dict(size=size, mode=mode)) if mode else dict()
    shape = model_shape('llama', None, seq=16, **OPTS)
    grid = 2 if mode == '2d' else 1
    saved = run_distributed(_llama_saved_per_token, size, dict(parallel=parallel))
    assert saved == [shape.block_values_per_token(mode, size, grid)] * size
    if mode:
        op = 'send' if mode == 'sequence' else None
        sent = run_distributed(_llama_block_bytes, size, dict(parallel=parallel), op)
        assert sent == [shape.block_comm_bytes(mode, size, 4)] * size
        layout = ParallelLayout(1, size, mode, 1, 1)
        est = evaluate(shape, load_profile('nvlink8'), Candidate(layout, 1), batch=4)
        assert est.terms['tensor_bytes_per_block'] == sent[0]


# the bands of tests/test_planner_memory.py's CASES for the same layouts (GPT)
MEMORY_CASES = [(Candidate(_l(d=4), 1, zero=3), (0.995, 1.005)),
                (Candidate(_l(d=4), 1), (0.995, 1.005)),
                (Candidate(_l(t=4, mode='1d'), 1), (0.94, 1.005))]


@pytest.mark.parametrize('cand,bounds', MEMORY_CASES,
                         ids=[c.describe().replace(' ', '_') for c, _ in MEMORY_CASES])
def test_peak_memory_equals_the_allocator_record(cand, bounds):
    check_peak_memory('llama', OPTS, cand, bounds)


def test_cli_plans_llama3_8b_on_64_devices(capsys):
    from colossal_lite.cli import main
    assert main(['plan', '--model', 'llama3-8b', '--devices', '64', '--memory-gb', '80',
                 '--batch', '64', '--seq', '2048', '--no-graph']) == 0   # the layer plan only
    out = capsys.readouterr().out
    assert 'chosen:' in out and "'type': 'llama'" in out
    result = plan('llama3-8b', devices=64, memory_gb=40, batch=64, seq=2048)
    layout = result.estimate.candidate.layout
    assert result.memory_per_device <= 40 * 2 ** 30 and layout.world_size == 64
    kv = model_shape('llama', 'llama3-8b').kv_heads
    split = {'1d': layout.tensor, '2d': layout.tensor_grid, '2.5d': layout.tensor_grid,
             '3d': layout.tensor_grid}.get(layout.mode, 1)
    assert kv % split == 0 or (layout.mode == '1d' and split % kv == 0), layout


def _spec(**opts):
    return job_spec(model_shape('llama', None, seq=16, **dict(OPTS, **opts)), 8)


def test_kv_heads_rules_name_the_key_before_any_worker():
    # 2D splits the heads over q = 2: 3 kv heads (6 query heads) cannot be split
    spec = _spec(hidden=48, heads=6, kv_heads=3, intermediate=96)
    with pytest.raises(ConfigError, match=r"'model\.kv_heads' \(key/value heads\) divisible "
                                          r"by 2, got 3"):
        check_layout(spec, ParallelLayout(1, 4, '2d', 1, 1))
    # 1D t=4 replicates 2 kv heads (2 | 4): accepted, meta build included
    check_layout(_spec(), ParallelLayout(1, 4, '1d', 1, 1))
    # 1D t=3 with 6 heads and 2 kv heads: 2 neither divides nor is divided by 3
    spec = _spec(hidden=48, heads=6, kv_heads=2, intermediate=96, vocab_size=258)
    with pytest.raises(ConfigError, match=r"'model\.kv_heads' \(key/value heads\) divisible "
                                          r"by 3 or dividing 3 .*got 2"):
        check_layout(spec, ParallelLayout(1, 3, '1d', 1, 1))
    # the search offers exactly what the rules accept
    shape = model_shape('llama', None, seq=16, **dict(OPTS, hidden=48, heads=6, kv_heads=2,
                                                      intermediate=96, vocab_size=258))
    assert ('1d', 3) not in {(l.mode, l.tensor) for l in layouts(shape, 3, 6)}
    assert ('1d', 6) in {(l.mode, l.tensor) for l in layouts(shape, 6, 6)}   # 2 | 6
