"""What the planner needs to know about a model_zoo model: its layers as the kinds of
``colossal_lite/formulas.py`` (parameters per rank in any layout), its FLOPs and the
activations one block saves.

A model is *first part -> n identical blocks -> last part* (``pipeline/stages.py``); a
pipelined model keeps the first part on stage 0 and the last on stage S-1, which also
holds the tied token embedding (GPT, BERT) when S > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

from .. import formulas

Layer = Tuple[str, dict]   # (formulas kind, its dims)


@dataclass(frozen=True)
class ModelShape:
    """A registered model's sizes: ``kind`` ('gpt', 'bert', 'vit'), ``preset``, its resolved
    ``options`` and the sequence length ``seq`` (ViT: 1 + patches)."""

    kind: str
    preset: Optional[str]
    options: Tuple[Tuple[str, object], ...]
    seq: int

    @cached_property
    def opts(self) -> Dict[str, object]:
        return dict(self.options)

    @cached_property
    def hidden(self) -> int:
        return self.opts['hidden']

    @cached_property
    def layers(self) -> int:
        return self.opts['layers']

    @cached_property
    def heads(self) -> int:
        return self.opts['heads']

    @cached_property
    def mlp_ratio(self) -> int:
        return self.opts.get('mlp_ratio', 4)

    @cached_property
    def outputs(self) -> int:
        """Width of the head's logits per token (vocabulary), or classes per sample (ViT)."""
        o = self.opts
        return o['vocab_size'] if 'vocab_size' in o else o['num_classes']

    # ---------------------------------------------------------------- layers
    def block_layers(self) -> List[Layer]:
        h, r = self.hidden, self.mlp_ratio
        def lin(fin, fout, region):
            return ('linear', dict(fin=fin, fout=fout, bias=True, region=region))
        return ([('layernorm', dict(h=h))] + [lin(h, h, 'enter')] * 3 + [lin(h, h, 'exit')]
                + [('layernorm', dict(h=h)), lin(h, r * h, 'enter'), lin(r * h, h, 'exit')])

    def first_layers(self) -> List[Layer]:
        o, h = self.opts, self.hidden
        if self.kind == 'gpt':
            return [('vocab_embedding', dict(v=o['vocab_size'], h=h)),
                    ('embedding', dict(v=o['max_positions'], h=h))]
        if self.kind == 'bert':
            return [('vocab_embedding', dict(v=o['vocab_size'], h=h)),
                    ('embedding', dict(v=o['max_positions'], h=h)),
                    ('embedding', dict(v=o.get('type_vocab_size', 2), h=h)),
                    ('layernorm', dict(h=h))]
        tokens = 1 + (o['img_size'] // o['patch_size']) ** 2
        return [('patch_embedding', dict(h=h, chans=o['in_chans'], patch=o['patch_size'],
                                         tokens=tokens))]

    def last_layers(self, pipelined: bool) -> List[Layer]:
        """The head's layers; a pipelined GPT/BERT's last stage also holds the tied embedding."""
        o, h = self.opts, self.hidden
        tied = ([('vocab_embedding', dict(v=o['vocab_size'], h=h))]
                if pipelined and self.kind != 'vit' else [])
        if self.kind == 'gpt':
            return [('layernorm', dict(h=h)),
                    ('vocab_classifier', dict(h=h, c=o['vocab_size'], bias=False, tied=True))
                    ] + tied
        if self.kind == 'bert':
            out = [('linear', dict(fin=h, fout=h, bias=True, region=None)),
                   ('layernorm', dict(h=h)),
                   ('vocab_classifier', dict(h=h, c=o['vocab_size'], bias=True, tied=True))]
            if o.get('nsp', True):
                out += [('linear', dict(fin=h, fout=h, bias=True, region=None)),
                        ('classifier', dict(h=h, c=2, bias=True))]
            return out + tied
        return [('layernorm', dict(h=h)), ('classifier', dict(h=h, c=o['num_classes'], bias=True))]

    # ---------------------------------------------------------------- FLOPs and activations
    def block_flops(self, tokens: float) -> float:
        """Forward FLOPs of one block on ``tokens`` = b*s tokens: the matmuls 2 (4 + 2r) h^2
        per token and attention's two products 4 s h per token."""
        h = self.hidden
        return tokens * (2 * (4 + 2 * self.mlp_ratio) * h * h + 4 * self.seq * h)

    def head_flops(self, samples: float) -> float:
        """Forward FLOPs of the head: the LM head on every token, a classifier on one."""
        if self.kind == 'vit':
            return 2.0 * samples * self.hidden * self.outputs
        return 2.0 * samples * self.seq * self.hidden * self.outputs

    def block_activation_bytes(self, samples: float, elem: int = 4) -> float:
        """Bytes one block of model_zoo's ``TransformerLayer`` saves for backward for
        ``samples`` sequences, unsharded: per token ``(8 + 2r) h + 4 + a`` values -- the
        inputs of the two LayerNorms and their outputs, q, k, v, the attention output, the
        fc1 output and the GELU output (8h + 2rh), the LayerNorms' mean and rstd (4) and the
        attention's log-sum-exp per head (a; ``scaled_dot_product_attention`` keeps no
        s x s matrix). Counted with ``saved_tensors_hooks`` on real blocks (a test); no
        dropout masks (dropout 0)."""
        return samples * self.seq * self.block_values_per_token() * elem

    def block_values_per_token(self, mode: Optional[str] = None, tensor: int = 1,
                               grid: int = 1) -> float:
        """Saved values per token of a block (:meth:`block_activation_bytes`) on one of
        ``tensor`` ranks of family ``mode`` (``grid``: the 2D/2.5D/3D grid side q). Counted
        with ``saved_tensors_hooks`` on real blocks of each family (tests):

        * none: ``(8 + 2r) h + 4 + a``;
        * 1D (Megatron): the LayerNorm inputs/outputs and statistics ``4h + 4`` replicated,
          the rest ``((4 + 2r) h + a) / t``;
        * 2D/2.5D/3D: everything ``/ t`` plus ``h / q`` (the LayerNorm's gathered
          statistics input);
        * sequence: everything ``/ t`` plus ``a (c s - 1) / t`` for the ring attention's
          per-head score statistics (c = 2 for GPT's causal attention, 1 for BERT)."""
        h, r, a = self.hidden, self.mlp_ratio, self.heads
        t = tensor if mode else 1
        if mode == '1d':
            return 4 * h + 4 + ((4 + 2 * r) * h + a) / t
        base = ((8 + 2 * r) * h + 4 + a) / t
        if mode in ('2d', '2.5d', '3d'):
            return base + h / grid
        if mode == 'sequence':
            return base + a * ((2 if self.kind == 'gpt' else 1) * self.seq - 1) / t
        return base


def layer_params(layers: List[Layer], mode: Optional[str], layout) -> int:
    """Elements one rank holds of ``layers`` under ``layout`` (``formulas.params``)."""
    table = formulas.params(mode, layout)
    return sum(table[kind](**dims) for kind, dims in layers)


def model_shape(kind: str, preset: Optional[str] = None, seq: Optional[int] = None,
                **overrides) -> ModelShape:
    """The :class:`ModelShape` of registered model ``kind`` at ``preset`` (+ overrides);
    ``seq`` defaults to ``max_positions`` (ViT: 1 + patches, fixed by the image)."""
    from ..models import get_model
    entry = get_model(kind)
    if kind not in ('gpt', 'bert', 'vit'):
        raise NotImplementedError(f"the planner describes model_zoo's 'gpt', 'bert' and 'vit'; "
                                  f"got {kind!r}")
    options = entry.options(preset, overrides)
    if kind == 'vit':
        tokens = 1 + (options['img_size'] // options['patch_size']) ** 2
        if seq not in (None, tokens):
            raise ValueError(f'ViT sequence length is fixed by the image: 1 + (img_size / '
                             f'patch_size)^2 = {tokens}, got seq={seq}')
        seq = tokens
    else:
        limit = options['max_positions']
        seq = limit if seq is None else seq
        if not 1 <= seq <= limit:
            raise ValueError(f'seq must be in [1, max_positions = {limit}], got {seq}')
    return ModelShape(kind, preset, tuple(sorted(options.items())), int(seq))


PRESET_KINDS = {'gpt': 'gpt', 'bert': 'bert', 'vit': 'vit'}


def resolve_model_name(name: str) -> Tuple[str, Optional[str]]:
    """'gpt2-small' -> ('gpt', 'gpt2-small'); 'vit:tiny' or 'vit-tiny' -> ('vit', 'tiny')."""
    from ..models import get_model, registered_models
    if ':' in name:
        kind, preset = name.split(':', 1)
        return kind, preset
    get_model('gpt')  # loads the entry points so every model_zoo preset is known
    found = []
    for kind in registered_models():
        presets = get_model(kind).presets
        if name in presets:
            found.append((kind, name))
        elif name.startswith(kind + '-') and name[len(kind) + 1:] in presets:
            found.append((kind, name[len(kind) + 1:]))
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"model {name!r} is a preset of {[k for k, _ in found]}: write "
                         f"'kind:preset', e.g. '{found[0][0]}:{found[0][1]}'")
    known = sorted(p for k in registered_models() for p in get_model(k).presets)
    raise ValueError(f"unknown model {name!r}: give a preset ({known}) or 'kind:preset' "
                     f"(e.g. 'gpt:tiny')")
