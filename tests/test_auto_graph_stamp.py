"""Capture by stamping repeated blocks (auto/graph/stamp.py) against the full trace.

* transformers' GPT-2, BERT, ViT, Llama, Qwen2 and GPT-NeoX with 5 blocks are stamped (two
  blocks traced) and give the full trace's ops in the same order, its placeholder table and
  its loss, bit for bit, from the real weights; so are T5's encoder and decoder, stamped from
  block 1 on (block 0 alone holds the relative-position bias every later block reads);
* not stamped, and equal to the full trace: Qwen2 with sliding-window attention from block
  2 on (its later blocks read another mask: same ops, same shapes), blocks whose later
  members run other ops, blocks sharing one parameter, a loop whose outputs are all read
  after it; stamped: blocks that all read one tensor made before them;
* a 4-block Llama through ``parallelize`` on 4 ranks (data 2 x tensor 2): random plans and
  the budgeted ``fast`` plan equal the serial model (loss, gradients, 3 AdamW steps).
"""
import warnings

import pytest
import torch
from torch import nn

import tests.auto_graph_models as agm
from colossal_lite.auto.graph.trace import capture
from colossal_lite.testing import run_distributed
from tests.test_auto_graph_models import SEEDS, STEPS, _budget_gb, _check, _rank, _serial

BLOCKS = 5


def _loss(captured, model, inputs):
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    values = [params[s] if k == 'param' else buffers[s] if k == 'buffer' else
              captured.constants[s] if k == 'constant' else inputs[s]
              for k, s in captured.inputs]
    with torch.no_grad():
        out = captured.graph_module(*values)
    return out[0] if isinstance(out, (tuple, list)) else out


def _stamped_as_full(model, inputs, loss_fn):
    """The stamped lists; asserts the capture equals the full trace (ops, table, loss)."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        full = capture(model, inputs, loss_fn, stamp_repeats=False)
        got = capture(model, inputs, loss_fn)
    ops = [(n.op, n.target) for n in full.graph.nodes if n.op != 'placeholder']
    assert [(n.op, n.target) for n in got.graph.nodes if n.op != 'placeholder'] == ops
    assert got.inputs == full.inputs
    want = _loss(full, model, inputs)
    assert torch.equal(_loss(got, model, inputs), want), want
    return got.stamped


@pytest.mark.parametrize('name, blocks', [
    ('gpt2', 'model.transformer.h'), ('bert', 'model.bert.encoder.layer'),
    ('vit', 'model.vit.layers'), ('llama', 'model.model.layers'),
    ('qwen2', 'model.model.layers'), ('gpt_neox', 'model.gpt_neox.layers'),
    ('t5', 'model.encoder.block model.decoder.block')])
def test_hf_models_are_stamped_and_equal_the_full_trace(name, blocks, monkeypatch):
    monkeypatch.setattr(agm, 'LAYERS', BLOCKS)
    case = agm.CASES[name]
    model = agm.llama(layers=BLOCKS) if name == 'llama' else case.build()
    assert _stamped_as_full(model, case.inputs(), case.loss_fn) == blocks.split()


def test_sliding_window_from_block_2_is_not_stamped():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=agm.VOCAB, hidden_size=agm.HIDDEN, intermediate_size=agm.FFN,
                      num_hidden_layers=BLOCKS, num_attention_heads=agm.HEADS,
                      num_key_value_heads=2, max_position_embeddings=32,
                      use_sliding_window=True, sliding_window=3, max_window_layers=2)
    assert cfg.layer_types[1] != cfg.layer_types[2]
    model = agm.CausalLM(Qwen2ForCausalLM(cfg))
    assert _stamped_as_full(model, agm._ids(), agm.output_loss) == []


class _Block(nn.Module):
    def __init__(self, index, shared=None, switch_at=None):
        super().__init__()
        self.lin = shared if shared is not None else nn.Linear(8, 8)
        self.index, self.switch_at = index, switch_at

    def forward(self, x, gate=None):
        y = self.lin(x)
        y = torch.tanh(y) if self.switch_at is not None and self.index >= self.switch_at \
            else torch.relu(y)
        return x + (y if gate is None else gate * y)


class _Stack(nn.Module):
    """``kind``: 'plain', 'switch' (blocks 3+ use tanh), 'shared' (one Linear for all),
    'gate' (every block reads one tensor made before the loop), 'every' (sums every
    block's output after the loop)."""

    def __init__(self, kind):
        super().__init__()
        shared = nn.Linear(8, 8) if kind == 'shared' else None
        self.blocks = nn.ModuleList(_Block(i, shared, 3 if kind == 'switch' else None)
                                    for i in range(BLOCKS))
        self.kind = kind

    def forward(self, x):
        gate = torch.sigmoid(x.mean()) if self.kind == 'gate' else None
        outs = []
        for block in self.blocks:
            x = block(x, gate)
            outs.append(x)
        return (sum(outs) if self.kind == 'every' else x).square().mean()


@pytest.mark.parametrize('kind, stamped', [('plain', True), ('gate', True), ('switch', False),
                                           ('shared', False), ('every', False)])
def test_blocks_that_differ_are_traced_whole(kind, stamped):
    torch.manual_seed(0)
    model = _Stack(kind)
    x = torch.randn(4, 8)
    assert _stamped_as_full(model, (x,), None) == (['blocks'] if stamped else [])


@pytest.mark.timeout(600)
def test_a_stamped_llama_on_4_ranks_equals_serial():
    serial = _serial('llama_deep')
    memory_gb = _budget_gb('llama_deep')
    results = run_distributed(_rank, 4, None, 'llama_deep', SEEDS, memory_gb, STEPS,
                              timeout=540)
    _check('llama_deep', results, serial)


def _plan_on_the_other_capture(rank):
    import functools

    from colossal_lite.auto.graph import api, trace
    warnings.simplefilter('ignore')
    case = agm.CASES['llama_deep']
    _, plan = api.parallelize(case.build(), case.inputs(), mesh=(1,))
    api.capture = functools.partial(trace.capture, stamp_repeats=False)
    try:
        api.parallelize(case.build(), case.inputs(), plan=plan)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_plan_of_a_stamped_capture_on_a_full_trace_is_an_error():
    (message,) = run_distributed(_plan_on_the_other_capture, 1, None, timeout=120)
    assert message is not None and 'this plan was made for another graph' in message, message
    assert 'stamped repeated blocks: none' in message
