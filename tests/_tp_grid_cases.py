"""Shared checks for the 2D / 2.5D families: each layer and each zoo model against serial.

The serial reference is computed in the parent process (no launch: serial layers) by
the same code the ranks run; the ranks build the parallel version from the serial
full weights and return their traces (``colossal_lite.testing``), which the parent
checks with ``assert_matches_serial``. Layouts: 'act' = standard activation layout,
'full' = user tensor.
"""
from __future__ import annotations

import torch

import colossal_lite.nn as col_nn
from colossal_lite.communication import collective as C
from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode
from colossal_lite.nn.parallel_2p5d import Grid2p5D
from colossal_lite.testing import Trace, assert_matches_serial, full_gradients, run_distributed

from tests.model_cases import FAMILIES, rank_traces, serial_traces

B, S, H, V, CLS = 8, 4, 16, 32, 10
TOL = 1e-5
MODEL_BATCH = dict(batch=8, seq=8)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _act(*shape, seed=0):
    return torch.randn(*shape, generator=_gen(seed))


class Layout:
    """Serial (grid None: identity) or parallel: how full tensors become local and back."""

    def __init__(self, grid=None):
        self.grid = grid

    def local(self, full, how):
        if self.grid is None or how == 'full':
            return full
        return self.grid.split_activation(full) if how == 'act' else self.grid.split_batch(full)

    def full(self, local, how):
        if self.grid is None:
            return local
        if how == 'act':
            return self.grid.gather_activation(local)
        with torch.no_grad():  # (detach() would drop the vocab-parallel tag)
            return col_nn.gather_logits(local)

    def total(self, partial_loss):
        """Sum of per-rank partial losses over the tensor group (identity when serial)."""
        if self.grid is None:
            return partial_loss
        return C.all_reduce(partial_loss, ParallelMode.TENSOR)


def _inputs(layout, spec):
    """spec: list of (full tensor, how, needs_grad) -> local leaf tensors."""
    out = []
    for full, how, grad in spec:
        t = layout.local(full, how).detach().clone()
        out.append(t.requires_grad_(grad))
    return out


# ----------------------------------------------------------------- layer cases
# each: build() -> module, inputs() -> [(full, how, grad)], run(module, *local) -> (out, how, loss)

def _upstream(layout, out, how, seed=7):
    g = _act(*layout.full(out, how).shape, seed=seed)
    return (out * layout.local(g, how)).sum()


def _case_linear(region, bias, fin, fout):
    def build():
        return col_nn.Linear(fin, fout, bias=bias, region=region)

    def inputs():
        return [(_act(B, S, fin, seed=1), 'act', True)]

    def run(layout, m, x):
        y = m(x)
        return y, 'act', _upstream(layout, y, 'act')
    return build, inputs, run


def _case_layernorm():
    def build():
        ln = col_nn.LayerNorm(H)
        with torch.no_grad():  # non-trivial affine parameters
            for p in ln.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=_gen(3)))
        return ln

    def run(layout, m, x):
        y = m(x)
        return y, 'act', _upstream(layout, y, 'act')
    return build, lambda: [(3.0 + _act(B, S, H, seed=2), 'act', True)], run


def _ids(seed=4, vocab=V):
    return torch.randint(0, vocab, (B, S), generator=_gen(seed))


def _case_embedding(vocab_parallel):
    def build():
        cls = col_nn.VocabParallelEmbedding if vocab_parallel else col_nn.Embedding
        return cls(V, H, padding_idx=3)

    def run(layout, m, ids):
        y = m(ids)
        return y, 'act', _upstream(layout, y, 'act')
    return build, lambda: [(_ids(), 'full', False)], run


def _case_patch():
    def build():
        return col_nn.PatchEmbedding(8, 2, 1, H)

    def run(layout, m, images):
        y = m(images)
        return y, 'act', _upstream(layout, y, 'act')
    return build, lambda: [(_act(B, 1, 8, 8, seed=5), 'full', False)], run


def _case_attention(causal):
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -1] = mask[6, -2:] = 0

    def build():
        return col_nn.AttentionCore(4, causal=causal)

    def inputs():
        return [(_act(B, S, H, seed=s), 'act', True) for s in (8, 9, 10)] + [(mask, 'full', False)]

    def run(layout, m, q, k, v, key_padding_mask):
        y = m(q, k, v, key_padding_mask)
        return y, 'act', _upstream(layout, y, 'act')
    return build, inputs, run


def _labels(shape, vocab, seed=11):
    labels = torch.randint(0, vocab, shape, generator=_gen(seed))
    labels.view(-1)[::5] = -100
    return labels


def _case_classifier(vocab_parallel, reduction):
    def build():
        if vocab_parallel:
            return col_nn.VocabParallelClassifier(H, V, bias=True)
        return col_nn.Classifier(H, CLS)

    def inputs():
        shape = (B, S) if vocab_parallel else (B,)
        labels = _labels(shape, V if vocab_parallel else CLS)
        return [(_act(*shape, H, seed=12), 'act', True), (labels, 'full', False)]

    def run(layout, m, x, labels):
        logits = m(x)
        loss = col_nn.CrossEntropyLoss(reduction=reduction)(logits, labels)
        if reduction == 'none':
            loss = (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum()
        return logits, 'logits', loss
    return build, inputs, run


def _case_first_token():
    def run(layout, m, x):
        y = col_nn.first_token(m(x))
        return y, 'act', _upstream(layout, y, 'act')
    return (lambda: col_nn.LayerNorm(H)), lambda: [(_act(B, S, H, seed=13), 'act', True)], run


class _QKV(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (col_nn.Linear(H, H, region='enter') for _ in range(3))


def _case_fused_qkv():
    """``col_nn.project_qkv`` (fused in this family); the serial fused projection equals
    three serial linears in tests/test_fused_qkv.py."""
    def run(layout, m, x):
        q, k, v = col_nn.project_qkv(x, m.query, m.key, m.value)
        y = q * k + v
        return y, 'act', _upstream(layout, y, 'act')
    return _QKV, lambda: [(_act(B, S, H, seed=14), 'act', True)], run


LAYER_CASES = {
    'linear_enter': _case_linear('enter', True, H, 2 * H),
    'fused_qkv': _case_fused_qkv(),
    'linear_exit_nobias': _case_linear('exit', False, 2 * H, H),
    'linear_none': _case_linear(None, True, H, H),
    'layernorm': _case_layernorm(),
    'embedding': _case_embedding(False),
    'vocab_parallel_embedding': _case_embedding(True),
    'patch_embedding': _case_patch(),
    'attention_causal_mask': _case_attention(True),
    'attention_mask': _case_attention(False),
    'classifier_ce_mean': _case_classifier(False, 'mean'),
    'vocab_classifier_ce_mean': _case_classifier(True, 'mean'),
    'vocab_classifier_ce_sum': _case_classifier(True, 'sum'),
    'vocab_classifier_ce_none': _case_classifier(True, 'none'),
    'first_token': _case_first_token(),
}


def run_layer_case(name, grid=None, state=None):
    """One forward + backward of a case as a one-step trace (full output, loss, input
    gradients, every parameter gradient) and the module's initial full state."""
    build, inputs, run = LAYER_CASES[name]
    layout = Layout(grid)
    torch.manual_seed(100)
    module = build()
    if state is not None:
        module.load_state_dict(state)
    initial = module.state_dict()
    spec = inputs()
    local = _inputs(layout, spec)
    out, how, loss = run(layout, module, *local)
    loss.backward()
    res = {'output.0': layout.full(out, how).detach(),
           'loss': layout.total(loss.detach()) if how == 'act' else loss.detach()}
    for n, (t, (_, h, g)) in enumerate(zip(local, spec)):
        if g:
            res[f'input_grad.{n}'] = layout.full(t.grad, h)
    res.update({f'grad:{k}': g for k, g in full_gradients(module).items()})
    return Trace([res]), initial


def check_layers(rank, states, comm_shape):
    """On every rank: each layer case's trace from the serial weights; one Linear's bytes."""
    grid = Grid2p5D.current()
    traces = {name: run_layer_case(name, grid, state)[0] for name, state in states.items()}
    return {'traces': traces, 'bytes': linear_bytes(grid, *comm_shape),
            'dropout': dropout_mask(grid)}


def run_layer_checks(world, config, grid_shape):
    """Every layer case on ``world`` ranks equals serial (on every rank), and the dropout
    masks pass :func:`check_dropout`; returns each rank's (bytes, wire bytes) of one Linear."""
    refs = {name: run_layer_case(name) for name in LAYER_CASES}   # serial: unlaunched
    states = {name: state for name, (_, state) in refs.items()}
    results = run_distributed(check_layers, world, config, states, (B, S, H), timeout=300)
    for name, (expected, _) in refs.items():
        assert_matches_serial([r['traces'][name] for r in results], expected, TOL)
    for res in results:
        check_dropout(*res['dropout'], grid_shape=grid_shape)
    return [res['bytes'] for res in results]


def dropout_mask(grid):
    """Dropout(0.5) of ones in the standard layout, gathered: (train output, eval output)."""
    drop = col_nn.Dropout(0.5)
    ones = grid.split_activation(torch.ones(B, S, H))
    train = grid.gather_activation(drop(ones))
    return train, grid.gather_activation(drop.eval()(ones))


def check_dropout(train, evaluated, grid_shape):
    """Values 0 or 1/(1-p); eval is identity; the ranks' blocks draw different masks."""
    assert torch.equal(evaluated, torch.ones_like(evaluated))
    assert set(train.unique().tolist()) == {0.0, 2.0}
    parts, q = grid_shape
    blocks = [blk for rows in train.chunk(parts, 0) for blk in rows.chunk(q, -1)]
    assert len({tuple(b.flatten().tolist()) for b in blocks}) == len(blocks)


def linear_bytes(grid, b, s, h):
    """Measured bytes of one Linear(h, h) forward + backward (input needs its gradient)."""
    layer = col_nn.Linear(h, h)
    x = grid.split_activation(torch.randn(b, s, h)).requires_grad_(True)
    with comm_profile() as stats:
        layer(x).sum().backward()
    return stats.bytes(), stats.wire_bytes()


# ----------------------------------------------------------------- models
def run_model_checks(world, config):
    """GPT, BERT and ViT on ``world`` ranks equal serial: loss, logits, every gradient and
    the parameters at each of 3 AdamW steps (DATA replicas take their rows of the batch)."""
    states, expected = serial_traces(FAMILIES, MODEL_BATCH)
    results = run_distributed(rank_traces, world, config, states, MODEL_BATCH, timeout=300)
    for name in FAMILIES:
        assert_matches_serial([r[name] for r in results], expected[name], TOL)
