"""Tiny GPT, BERT, ViT and Llama cases shared by the model tests of every layout.

``make_case(name, batch, seq)`` gives a :class:`Case`: ``build(**overrides)`` (the model
for the launched layout), the global ``batch = (inputs, labels)`` in the engine's form
and ``criterion()`` (``criterion(outputs, *labels)``). Everything is deterministic, so
the parent (serial reference) and every forked rank build the same data. Every BERT row
has the same number of masked-LM labels (a data-parallel replica's mean is then a share
of the serial mean), crowded into the first part of the sequence (sequence ranks hold
uneven counts); padded tails differ in length.

``case_trace`` / ``serial_traces`` put a case through ``colossal_lite.testing``'s
harness, serially and on every rank alike.
"""
from typing import Any, Callable, NamedTuple, Tuple

import torch

import colossal_lite.nn as col_nn
from colossal_lite.testing import make_optimizer, plain_step, training_trace
from model_zoo import BERT, GPT, Llama, ViT, BertPretrainingLoss, GPTLMLoss

FAMILIES = ('gpt', 'bert', 'vit')  # the families every layout's tests run; Llama: test_llama
MODELS = {'gpt': GPT, 'bert': BERT, 'vit': ViT, 'llama': Llama}
CRITERIA = {'gpt': GPTLMLoss, 'bert': BertPretrainingLoss, 'vit': col_nn.CrossEntropyLoss,
            'llama': GPTLMLoss}


class Case(NamedTuple):
    build: Callable[..., torch.nn.Module]
    inputs: Tuple[torch.Tensor, ...]
    labels: Any
    criterion: Callable[[], Callable]

    @property
    def batch(self):
        """``(inputs, labels)`` as the engine takes it (a lone input tensor unwrapped)."""
        return (self.inputs[0] if len(self.inputs) == 1 else self.inputs), self.labels


def _gpt(g, batch, seq):
    ids = torch.randint(0, 256, (batch, seq), generator=g)
    return (ids,), ids


def _bert(g, batch, seq):
    ids = torch.randint(0, 256, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 5:] = 0          # padded tails of different lengths
    mask[-1, seq - 3:] = 0
    mlm = torch.full((batch, seq), -100)
    for pos in list(range(seq * 3 // 8)) + [seq * 3 // 4]:   # s=16: 0..5 and 12
        mlm[:, pos] = ids[:, pos]
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return (ids, mask), (mlm, nsp)


def _vit(g, batch, seq, img_size=8):
    images = torch.randn(batch, 1, img_size, img_size, generator=g)
    return (images,), torch.randint(0, 10, (batch,), generator=g)


def make_case(name: str, batch: int = 4, seq: int = 16, seed: int = 0, img_size=None,
              **overrides) -> Case:
    """``overrides`` go to ``from_preset('tiny', ...)``; ``img_size`` sizes ViT's images
    and model (the other families ignore it)."""
    g = torch.Generator().manual_seed(seed + {'gpt': 1, 'bert': 2, 'vit': 3, 'llama': 4}[name])
    data = {'gpt': _gpt, 'bert': _bert, 'vit': _vit, 'llama': _gpt}[name]
    if name == 'vit' and img_size is not None:
        overrides['img_size'] = img_size
        inputs, labels = data(g, batch, seq, img_size)
    else:
        inputs, labels = data(g, batch, seq)
    return Case(lambda **more: build(name, **overrides, **more), inputs, labels,
                CRITERIA[name])


def build(name: str, **overrides) -> torch.nn.Module:
    return MODELS[name].from_preset('tiny', **overrides)


def criterion(name: str):
    return CRITERIA[name]()


def global_batch(name: str, seed: int = 0, batch: int = 8, seq: int = 8):
    """A global ``(inputs, labels)`` batch of a case (as the engine takes it)."""
    return make_case(name, batch=batch, seq=seq, seed=seed).batch


def serial_state(name: str, weight_seed: int = 0, **case_kw) -> dict:
    """The serial model's initial full state dict (weights drawn by name with
    ``weight_seed``)."""
    model = make_case(name, **case_kw).build
    torch.manual_seed(weight_seed)
    return {k: v.clone() for k, v in model().state_dict().items()}


def reference_trace(name: str, state: dict, batches, steps: int = 3, clip: float = 0.0,
                    **overrides):
    """The serial reference of an engine run: a plain torch loop (torch's clipping when
    ``clip``; AdamW of ``make_optimizer``) from ``state``; outputs are not recorded."""
    model = build(name, **overrides)
    model.load_state_dict(state)
    step = plain_step(criterion(name), make_optimizer(model.parameters()), clip=clip,
                      outputs=False)
    return training_trace(model, batches, steps=steps, step_fn=step)


def case_trace(name: str, state: dict, steps: int = 3, case_kw=None, **trace_kw):
    """A case's model loaded with ``state``, trained through ``training_trace`` on the
    case's global batch (``case_kw`` -> make_case, ``trace_kw`` -> training_trace)."""
    case = make_case(name, **(case_kw or {}))
    model = case.build()
    model.load_state_dict(state)
    return training_trace(model, case.batch, case.criterion(), steps=steps, **trace_kw)


def serial_traces(names, case_kw=None, **trace_kw):
    """(initial states, serial traces) of the named cases, computed in this (unlaunched)
    process."""
    states = {name: serial_state(name, **(case_kw or {})) for name in names}
    return states, {name: case_trace(name, states[name], case_kw=case_kw, **trace_kw)
                    for name in names}


def rank_traces(rank, states, case_kw=None, trace_kw=None):
    """On every rank: the traces of the cases in ``states`` (for run_distributed)."""
    return {name: case_trace(name, state, case_kw=case_kw, **(trace_kw or {}))
            for name, state in states.items()}
