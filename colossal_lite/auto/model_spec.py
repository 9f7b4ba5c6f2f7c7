"""What the planner needs to know about a registered model: its layers as the kinds of
``colossal_lite/formulas.py`` (parameters per rank in any layout), its FLOPs and the
activations one block saves -- read through the registry entry's ``PlannerShape`` (which
options hold the sizes) and ``ModelTraits`` (its structure), never through its name.

A model is *first part -> n identical blocks -> last part* (``pipeline/stages.py``); a
pipelined model keeps the first part on stage 0 and the last on stage S-1, which also
holds the token embedding when the head is tied to it and S > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import colossal_lite.formulas as formulas

from ..models import ModelTraits, PlannerShape, get_model, load_entry_points, registered_models

Layer = Tuple[str, dict]   # (formulas kind, its dims)


@dataclass(frozen=True)
class ModelShape:
    """A registered model's sizes: ``kind`` (its registry name), ``preset``, its resolved
    ``options`` and the sequence length ``seq`` (an image model: 1 + patches). The sizes and
    the structure come from the entry's ``shape`` and ``traits`` (``colossal_lite.models``)."""

    kind: str
    preset: Optional[str]
    options: Tuple[Tuple[str, object], ...]
    seq: int

    @cached_property
    def opts(self) -> Dict[str, object]:
        return dict(self.options)

    @cached_property
    def names(self) -> PlannerShape:
        """Which options hold the sizes (the entry's ``shape``)."""
        return planner_entry(self.kind).shape

    @cached_property
    def traits(self) -> ModelTraits:
        return planner_entry(self.kind).traits

    def option(self, name: str):
        """Option ``name``, else the builder's default (``ModelEntry.option``)."""
        return get_model(self.kind).option(self.opts, name)

    @cached_property
    def hidden(self) -> int:
        return self.option(self.names.hidden)

    @cached_property
    def layers(self) -> int:
        return self.option(self.names.layers)

    @cached_property
    def heads(self) -> int:
        return self.option(self.names.heads)

    @cached_property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention), else ``heads``."""
        return self.option(self.names.kv_heads) if self.names.kv_heads else self.heads

    @cached_property
    def mlp_ratio(self):
        """The MLP's inner width over h (an int where it divides)."""
        if self.names.ffn is None:
            return self.option(self.names.mlp_ratio)
        ffn = self.option(self.names.ffn)
        return ffn // self.hidden if ffn % self.hidden == 0 else ffn / self.hidden

    @cached_property
    def ffn(self) -> int:
        """The MLP's inner width."""
        if self.names.ffn is not None:
            return self.option(self.names.ffn)
        return self.mlp_ratio * self.hidden

    @cached_property
    def vocab(self) -> Optional[int]:
        """Token-embedding rows (None: no token input)."""
        return self.option(self.names.vocab) if self.names.vocab else None

    @cached_property
    def outputs(self) -> int:
        """Width of the head's logits per token (vocabulary), or classes per sample."""
        return self.option(self.names.classes) if self.names.classes else self.vocab

    # ---------------------------------------------------------------- layers
    def block_layers(self) -> List[Layer]:
        """LayerNorm, q/k/v (k and v of ``kv_heads`` heads) and output projections, LayerNorm,
        the MLP's input projection (two when gated) and its output projection."""
        h, f = self.hidden, self.ffn
        kv = self.kv_heads * (h // self.heads)
        def lin(fin, fout, region):
            return ('linear', dict(fin=fin, fout=fout, bias=True, region=region))
        mlp_in = [lin(h, f, 'enter')] * (2 if self.traits.gated_mlp else 1)
        return ([('layernorm', dict(h=h)), lin(h, h, 'enter'), lin(h, kv, 'enter'),
                 lin(h, kv, 'enter'), lin(h, h, 'exit'), ('layernorm', dict(h=h))]
                + mlp_in + [lin(f, h, 'exit')])

    def first_layers(self) -> List[Layer]:
        """The embeddings: tokens, learned positions, token types, or an image's patches;
        then a LayerNorm where ``traits.embedding_norm``."""
        names, h = self.names, self.hidden
        out: List[Layer] = []
        if names.vocab:
            out.append(('vocab_embedding', dict(v=self.vocab, h=h)))
        for rows in (names.positions, names.segments):
            if rows:
                out.append(('embedding', dict(v=self.option(rows), h=h)))
        if names.image:
            out.append(('patch_embedding', dict(h=h, chans=self.option(names.channels),
                                                patch=self.option(names.patch),
                                                tokens=image_tokens(self.option(names.image),
                                                                    self.option(names.patch)))))
        if self.traits.embedding_norm:
            out.append(('layernorm', dict(h=h)))
        return out

    def last_layers(self, pipelined: bool) -> List[Layer]:
        """The head's layers: the final LayerNorm (pre-LN), the head transform, the head
        (vocabulary-parallel unless it outputs classes), the pooled pair classifier; a
        pipelined model's last stage also holds the token embedding a tied head uses."""
        names, traits, h = self.names, self.traits, self.hidden
        out: List[Layer] = [('layernorm', dict(h=h))] if traits.final_norm else []
        if traits.head_transform:
            out += [('linear', dict(fin=h, fout=h, bias=True, region=None)),
                    ('layernorm', dict(h=h))]
        if names.classes:
            out.append(('classifier', dict(h=h, c=self.outputs, bias=traits.head_bias)))
        else:
            out.append(('vocab_classifier', dict(h=h, c=self.outputs, bias=traits.head_bias,
                                                 tied=traits.tied_head)))
        if names.pair_head and self.option(names.pair_head):
            out += [('linear', dict(fin=h, fout=h, bias=True, region=None)),
                    ('classifier', dict(h=h, c=2, bias=True))]
        if pipelined and traits.tied_head:
            out.append(('vocab_embedding', dict(v=self.vocab, h=h)))
        return out

    def model_numels(self) -> List[int]:
        """Serial elements of each parameter tensor in model (= first-use) order, the tied
        head's weight once (as the unpipelined model holds it)."""
        return (tensor_numels(self.first_layers()) + tensor_numels(self.block_layers())
                * self.layers + tensor_numels(self.last_layers(False)))

    # ---------------------------------------------------------------- FLOPs and activations
    def block_flops(self, tokens: float) -> float:
        """Forward FLOPs of one block on ``tokens`` = b*s tokens: the matmuls 2 (4 + 2r) h^2
        per token and attention's two products 4 s h per token."""
        h = self.hidden
        return tokens * (2 * (4 + 2 * self.mlp_ratio) * h * h + 4 * self.seq * h)

    def head_flops(self, samples: float) -> float:
        """Forward FLOPs of the head: on every token (a language model) or on one (a
        classifier, ``traits.head_per_token`` False)."""
        if not self.traits.head_per_token:
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
          per-head score statistics (c = 2 for causal attention, ``traits.causal``, else 1)."""
        h, r, a = self.hidden, self.mlp_ratio, self.heads
        t = tensor if mode else 1
        if mode == '1d':
            return 4 * h + 4 + ((4 + 2 * r) * h + a) / t
        base = ((8 + 2 * r) * h + 4 + a) / t
        if mode in ('2d', '2.5d', '3d'):
            return base + h / grid
        if mode == 'sequence':
            return base + a * ((2 if self.traits.causal else 1) * self.seq - 1) / t
        return base


def layer_params(layers: List[Layer], mode: Optional[str], layout) -> int:
    """Elements one rank holds of ``layers`` under ``layout`` (``formulas.params``)."""
    table = formulas.params(mode, layout)
    return sum(table[kind](**dims) for kind, dims in layers)


def tensor_numels(layers: List[Layer]) -> List[int]:
    """Serial elements of each parameter tensor of ``layers``, in order (a tied weight: none)."""
    out: List[int] = []
    for kind, a in layers:
        if kind == 'linear':
            out += [a['fin'] * a['fout']] + ([a['fout']] if a['bias'] else [])
        elif kind == 'layernorm':
            out += [a['h'], a['h']]
        elif kind in ('embedding', 'vocab_embedding'):
            out.append(a['v'] * a['h'])
        elif kind in ('vocab_classifier', 'classifier'):
            out += (([] if a.get('tied') else [a['c'] * a['h']])
                    + ([a['c']] if a.get('bias') else []))
        elif kind == 'patch_embedding':
            out += [a['h'] * a['chans'] * a['patch'] ** 2, a['h'], a['h'], a['tokens'] * a['h']]
        else:
            raise NotImplementedError(f'the chunk count knows no layer kind {kind!r}')
    return out


def image_tokens(image: int, patch: int) -> int:
    """Tokens of a patch embedding: the class token and (image / patch)^2 patches."""
    return 1 + (image // patch) ** 2


def planner_entry(kind: str):
    """The registry entry of ``kind``; NotImplementedError when it has no planner shape."""
    entry = get_model(kind)
    if entry.shape is None:
        raise NotImplementedError(
            f"model {kind!r} is registered without a planner shape: register_model(..., "
            f"shape=PlannerShape(...), traits=ModelTraits(...)) describes it to the planner")
    return entry


def model_shape(kind: str, preset: Optional[str] = None, seq: Optional[int] = None,
                **overrides) -> ModelShape:
    """The :class:`ModelShape` of registered model ``kind`` at ``preset`` (+ overrides);
    ``seq`` defaults to the option ``PlannerShape.seq`` names (an image model: 1 + patches,
    fixed by the image). NotImplementedError for what the FLOP and activation formulas do not
    model yet (grouped-query attention, a gated MLP)."""
    entry = planner_entry(kind)
    names, traits = entry.shape, entry.traits
    options = entry.options(preset, overrides)
    if traits.gated_mlp or (names.kv_heads and entry.option(options, names.kv_heads)
                            != entry.option(options, names.heads)):
        raise NotImplementedError(f'the planner counts the parameters of {kind!r} but its FLOP '
                                  f'and activation formulas assume multi-head attention and a '
                                  f'two-matrix MLP')
    if names.image:
        image, patch = entry.option(options, names.image), entry.option(options, names.patch)
        tokens = image_tokens(image, patch)
        if seq not in (None, tokens):
            raise ValueError(f'{entry.label or kind} sequence length is fixed by the image: '
                             f'1 + ({names.image} / {names.patch})^2 = {tokens}, got seq={seq}')
        seq = tokens
    else:
        limit = entry.option(options, names.seq) if names.seq else None
        if seq is None and limit is None:
            raise ValueError(f'model {kind!r} names no longest sequence: give seq')
        seq = limit if seq is None else seq
        if not 1 <= seq <= (limit or seq):
            raise ValueError(f'seq must be in [1, {names.seq} = {limit}], got {seq}')
    return ModelShape(kind, preset, tuple(sorted(options.items())), int(seq))


def resolve_model_name(name: str) -> Tuple[str, Optional[str]]:
    """A preset name -> (kind, preset) of the one registered model that has it; 'kind:preset'
    and 'kind-preset' name both (entry points loaded first, so every installed model's
    presets are known)."""
    if ':' in name:
        kind, preset = name.split(':', 1)
        return kind, preset
    load_entry_points()
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
    pairs = [(k, p) for k in registered_models() for p in get_model(k).presets]
    example = f" (e.g. '{pairs[0][0]}:{pairs[0][1]}')" if pairs else ''
    raise ValueError(f"unknown model {name!r}: give a preset ({sorted(p for _, p in pairs)}) or "
                     f"'kind:preset'{example}")
