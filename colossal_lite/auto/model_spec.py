"""What the planner needs to know about a registered model: its layers as the kinds of
``colossal_lite/formulas.py`` plus ``rmsnorm`` and ``kv_linear`` (:func:`param_formulas`:
parameters per rank in any layout), its FLOPs, the activations one block saves and its
tensor-parallel bytes -- read through the registry entry's ``PlannerShape`` (which options
hold the sizes) and ``ModelTraits`` (its structure), never through its name. One set of
formulas, parametrized by the traits: grouped-query attention (n_kv heads, 1D's replicated
kv heads), a gated MLP, RMSNorm, biases or none, rotary positions, a tied or untied head.

A model is *first part -> n identical blocks -> last part* (``pipeline/stages.py``); a
pipelined model keeps the first part on stage 0 and the last on stage S-1, which also
holds the token embedding when the head is tied to it and S > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import colossal_lite.formulas as formulas

from ..config.families import family
from ..models import ModelTraits, PlannerShape, get_model, load_entry_points, registered_models

Layer = Tuple[str, dict]   # (formulas kind, its dims)


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts model's MLP (``PlannerShape.moe``, docs/moe.md): ``experts`` X
    SwiGLU experts of width ``ffn`` f, ``top_k`` k per token, the always-on shared experts
    stored as one SwiGLU of width ``shared`` (n f_s; 0: none) with a sigmoid gate
    (``shared_gate``), the first ``first_dense`` blocks dense; ``tensor_parallel`` the
    option ``expert_tensor_parallel`` (None: on under 1D, False: experts whole)."""

    experts: int
    top_k: int
    ffn: int
    shared: int = 0
    shared_gate: bool = False
    first_dense: int = 0
    tensor_parallel: Optional[bool] = None

    def expert_tensor(self, mode: Optional[str], tensor: int) -> int:
        """t_e: the ranks each expert's width is cut over (expert tensor parallelism: the 1D
        group unless ``tensor_parallel`` is False), else 1."""
        return tensor if mode == '1d' and tensor > 1 and self.tensor_parallel is not False \
            else 1


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
        """The resolved options (``options`` holds them frozen, so a shape is hashable)."""
        return {k: _thaw(v) for k, v in self.options}

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
        """Key/value heads n_kv (grouped-query attention), else ``heads``."""
        kv = self.option(self.names.kv_heads) if self.names.kv_heads else None
        return self.heads if kv is None else kv

    @cached_property
    def head_dim(self) -> int:
        """d = h / heads."""
        return self.hidden // self.heads

    @cached_property
    def kv_dim(self) -> int:
        """Width of the k (and of the v) projection, n_kv * d."""
        return self.kv_heads * self.head_dim

    @cached_property
    def tied_head(self) -> bool:
        """The head's weight is the token embedding's (option ``PlannerShape.tie_head``,
        else ``traits.tied_head``)."""
        names = self.names
        return bool(self.option(names.tie_head)) if names.tie_head else self.traits.tied_head

    @cached_property
    def qkv_bias(self) -> bool:
        """The q/k/v projections have biases (option ``PlannerShape.qkv_bias``, else
        ``traits.linear_bias``)."""
        names = self.names
        return bool(self.option(names.qkv_bias)) if names.qkv_bias else self.traits.linear_bias

    @cached_property
    def moe(self) -> Optional[MoESpec]:
        """The :class:`MoESpec` of the option ``PlannerShape.moe`` names, None for a dense
        model."""
        name = getattr(self.names, 'moe', None)
        spec = self.option(name) if name else None
        if not spec:
            return None
        ffn = spec.get('ffn_hidden') or self.ffn
        shared = spec.get('shared_experts', 0) * (spec.get('shared_ffn_hidden') or ffn)
        return MoESpec(spec['experts'], spec['top_k'], ffn, shared,
                       bool(shared and spec.get('shared_gate')), spec.get('first_dense', 0),
                       spec.get('expert_tensor_parallel'))

    @cached_property
    def moe_layers(self) -> int:
        """Blocks with an MoE MLP (``layers - first_dense``; 0 for a dense model)."""
        return self.layers - self.moe.first_dense if self.moe else 0

    def dense_blocks(self, blocks) -> int:
        """How many of the serial block indices ``blocks`` are dense (an MoE model's first
        ``first_dense``; all of a dense model's)."""
        if self.moe is None:
            return len(blocks)
        return sum(1 for i in blocks if i < self.moe.first_dense)

    @cached_property
    def dense(self) -> 'ModelShape':
        """This model without its MoE option: the shape of its dense blocks (the first
        ``first_dense``), a dense model itself."""
        name = getattr(self.names, 'moe', None)
        if self.moe is None:
            return self
        return ModelShape(self.kind, self.preset, tuple((k, None if k == name else v)
                                                        for k, v in self.options), self.seq)

    @cached_property
    def mlp_inputs(self) -> int:
        """The MLP's input projections: 2 when gated (gate and up), else 1."""
        return 2 if self.traits.gated_mlp else 1

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
            ffn = self.option(self.names.ffn)
            if ffn is None:
                raise ValueError(f'model {self.kind!r}: give option {self.names.ffn!r} (the '
                                 f"planner does not know the builder's default MLP width)")
            return ffn
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
        """The norm (LayerNorm, or RMSNorm where ``traits.rms_norm``), q ``[h -> h]``, k and v
        ``[h -> n_kv d]`` (kind ``kv_linear``: split with the heads, or replicated where the
        family replicates kv heads, :func:`kv_replicated`), o ``[h -> h]``, the norm, the MLP's
        input projection ``[h -> i]`` (gate and up when ``traits.gated_mlp``) and its output
        projection ``[i -> h]``; biases where ``traits.linear_bias`` (q/k/v: :attr:`qkv_bias`).
        Rotary positions add no parameters."""
        h, f, bias = self.hidden, self.ffn, self.traits.linear_bias
        norm = ('rmsnorm' if self.traits.rms_norm else 'layernorm', dict(h=h))
        def lin(fin, fout, region, b=bias):
            return ('linear', dict(fin=fin, fout=fout, bias=b, region=region))
        kv = ('kv_linear', dict(fin=h, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                bias=self.qkv_bias))
        attention = [norm, lin(h, h, 'enter', self.qkv_bias), kv, kv, lin(h, h, 'exit'), norm]
        moe = self.moe
        if moe is None:
            return attention + [lin(h, f, 'enter')] * self.mlp_inputs + [lin(f, h, 'exit')]
        # an MoE block: the router [X, h] (replicated), the stacked experts (kind 'experts':
        # cut over EXPERT and, under expert tensor parallelism, their width over TENSOR),
        # the shared experts as one SwiGLU of width n f_s (split as a 1D MLP) and their gate
        out = attention + [('replicated', dict(n=moe.experts * h)),
                           ('experts', dict(experts=moe.experts, h=h, f=moe.ffn,
                                            tensor_parallel=moe.tensor_parallel))]
        if moe.shared:
            out += [lin(h, moe.shared, 'enter', False)] * 2 + [lin(moe.shared, h, 'exit', False)]
        if moe.shared_gate:
            out.append(('replicated', dict(n=h)))
        return out

    def dense_block_layers(self) -> List[Layer]:
        """A dense block's layers (:meth:`block_layers` of a dense model; an MoE model's
        first ``first_dense`` blocks)."""
        return self.dense.block_layers()

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
        """The head's layers: the final norm (pre-LN), the head transform, the head
        (vocabulary-parallel unless it outputs classes), the pooled pair classifier; a
        pipelined model's last stage also holds the token embedding a tied head uses."""
        names, traits, h = self.names, self.traits, self.hidden
        norm = 'rmsnorm' if traits.rms_norm else 'layernorm'
        out: List[Layer] = [(norm, dict(h=h))] if traits.final_norm else []
        if traits.head_transform:
            out += [('linear', dict(fin=h, fout=h, bias=True, region=None)),
                    ('layernorm', dict(h=h))]
        if names.classes:
            out.append(('classifier', dict(h=h, c=self.outputs, bias=traits.head_bias)))
        else:
            out.append(('vocab_classifier', dict(h=h, c=self.outputs, bias=traits.head_bias,
                                                 tied=self.tied_head)))
        if names.pair_head and self.option(names.pair_head):
            out += [('linear', dict(fin=h, fout=h, bias=True, region=None)),
                    ('classifier', dict(h=h, c=2, bias=True))]
        if pipelined and self.tied_head:
            out.append(('vocab_embedding', dict(v=self.vocab, h=h)))
        return out

    def model_numels(self) -> List[int]:
        """Serial elements of each parameter tensor in model (= first-use) order, the tied
        head's weight once (as the unpipelined model holds it)."""
        dense = self.layers - self.moe_layers if self.moe else 0
        return (tensor_numels(self.first_layers())
                + tensor_numels(self.dense_block_layers()) * dense
                + tensor_numels(self.block_layers()) * (self.layers - dense)
                + tensor_numels(self.last_layers(False)))

    # ---------------------------------------------------------------- FLOPs and activations
    @cached_property
    def block_calls(self) -> Tuple[Tuple[int, int, bool], ...]:
        """The block's matmuls as the runtime calls them, ``(fan_in, fan_out, bias)``: q, k
        and v fused into one ``[h -> h + 2 n_kv d]`` (``col_nn.project_qkv``), o
        ``[h -> h]``, each MLP input projection ``[h -> i]`` (gate and up when gated; called
        apart) and the output projection ``[i -> h]``."""
        h, f, bias = self.hidden, self.ffn, self.traits.linear_bias
        attention = ((h, h + 2 * self.kv_dim, self.qkv_bias), (h, h, bias))
        if self.moe is not None:   # an MoE block: the shared experts' SwiGLU, if any
            s = self.moe.shared
            return attention + (((h, s, False),) * 2 + ((s, h, False),) if s else ())
        return attention + ((h, f, bias),) * self.mlp_inputs + ((f, h, bias),)

    def block_flops(self, tokens: float) -> float:
        """Forward FLOPs of one block on ``tokens`` = b*s tokens: 2 per weight element of its
        matmuls per token, ``2 (2 h^2 + 2 h n_kv d + (1 + g) h i)`` (g = 2 gated, else 1;
        GPT: ``2 (4 + 2r) h^2``), and attention's two products ``4 s h`` per token (per query
        head, whatever n_kv; the causal half not discounted). Elementwise work (norms,
        rotary, GELU / SiLU, softmax, biases) is not counted."""
        weights = sum(fan_in * fan_out for fan_in, fan_out, _ in self.block_calls)
        return tokens * (2 * weights + 4 * self.seq * self.hidden) + self.routed_flops(tokens)

    def routed_flops(self, tokens: float) -> float:
        """An MoE block's forward FLOPs beyond :attr:`block_calls` on ``tokens`` tokens: the
        router ``2 h X`` and the k experts' SwiGLU ``k 3 2 h f`` per token (uniform: every
        token's k slots cost the same), the shared gate ``2 h``; 0 for a dense block."""
        moe = self.moe
        if moe is None:
            return 0.0
        h = self.hidden
        return tokens * (2 * h * moe.experts + moe.top_k * 6 * h * moe.ffn
                         + 2 * h * moe.shared_gate)

    def replicated_flops(self, tokens: float, mode: Optional[str], tensor: int) -> float:
        """Of :meth:`block_flops`, what every tensor rank computes whole under 1D (the same
        tokens on each rank): the router and gate and, without expert tensor parallelism,
        the experts. 0 elsewhere (the sequence modes split the tokens)."""
        moe = self.moe
        if moe is None or mode != '1d' or tensor == 1:
            return 0.0
        h = self.hidden
        out = tokens * (2 * h * moe.experts + 2 * h * moe.shared_gate)
        if moe.expert_tensor(mode, tensor) == 1:
            out += tokens * moe.top_k * 6 * h * moe.ffn
        return out

    def head_flops(self, samples: float) -> float:
        """Forward FLOPs of the head: on every token (a language model) or on one (a
        classifier, ``traits.head_per_token`` False)."""
        if not self.traits.head_per_token:
            return 2.0 * samples * self.hidden * self.outputs
        return 2.0 * samples * self.seq * self.hidden * self.outputs

    def block_activation_bytes(self, samples: float, elem: int = 4) -> float:
        """Bytes one block saves for backward for ``samples`` sequences, unsharded:
        :meth:`block_values_per_token` of the serial block (GPT: ``(8 + 2r) h + 4 + a``).
        No dropout masks (dropout 0)."""
        return samples * self.seq * self.block_values_per_token() * elem

    def norm_values_per_token(self, mode: Optional[str] = None, tensor: int = 1,
                              grid: int = 1) -> float:
        """Saved values per token of one norm on a rank (:meth:`block_values_per_token`): a
        LayerNorm ``2h + 2`` (input, output, mean and rstd), an RMSNorm ``3h + 1`` (input, the
        normalized fp32 values, output, rstd); 1D replicates them; 2D/2.5D/3D: LayerNorm
        ``(2h + 2) / t + h / (2q)`` (its gathered statistics input), RMSNorm ``(3h + q) / t``
        (one statistic per local token: ``1 / batch split = q / t``); sequence ``/ t``."""
        h, rms = self.hidden, self.traits.rms_norm
        t = tensor if mode not in (None, '1d') else 1
        if mode in ('2d', '2.5d', '3d'):
            return (3 * h + grid) / t if rms else (2 * h + 2) / t + h / (2 * grid)
        return (3 * h + 1 if rms else 2 * h + 2) / t

    def block_values_per_token(self, mode: Optional[str] = None, tensor: int = 1,
                               grid: int = 1, ring: int = 1) -> float:
        """Saved values per token of a block on one of ``tensor`` ranks of family ``mode``
        (``grid``: the 2D/2.5D/3D grid side q), counted with ``saved_tensors_hooks`` on real
        blocks (tests: GPT and BERT in every family, Llama serial, 1D and 2D). Serially:
        two norms (:meth:`norm_values_per_token`); attention ``h + 2 kv`` (the fused q/k/v
        output, one storage; kv = n_kv d), the rotated q and k ``h + kv`` (``traits.rotary``),
        its output ``h`` and log-sum-exp per head ``a`` (``scaled_dot_product_attention``
        keeps no s x s matrix); the MLP's hidden ``2 i`` (fc1 and GELU outputs) or, gated,
        ``4 i`` (gate, SiLU, up outputs and their product). GPT: ``(8 + 2r) h + 4 + a``.
        On a rank everything but the norms is ``/ t`` (none: t = 1), the k/v terms of the local
        kv width: ``d`` per rank where 1D replicates the kv heads (t > n_kv); the sequence
        ring (online softmax) saves q, k, v, the output and the log-sum-exp, as serial.
        Ulysses (``ring`` = R, U = t / R): attention saves the all_to_all outputs q
        ``h`` and the stacked k, v ``2 n' d`` (n' = :func:`ulysses_kv_heads`), its output
        ``h`` and log-sum-exp ``a`` and, after the all_to_all back, the o projection's
        input ``h``, all ``/ t`` -- neither the fused q/k/v output nor the rotated q, k
        (no op keeps them); ``(3h + 2 n' d + a) / t``."""
        h, a, f = self.hidden, self.heads, self.ffn
        t = tensor if mode else 1
        mlp = 2 * self.mlp_inputs * f / t if self.moe is None else self.moe_values_per_token(
            mode, t)
        norms = 2 * self.norm_values_per_token(mode, tensor, grid)
        if mode == 'ulysses':
            kv_heads = ulysses_kv_heads(self.kv_heads, tensor // ring)
            return norms + (3 * h + 2 * kv_heads * self.head_dim + a) / t + mlp
        kv = self.local_kv_width(mode, tensor) if mode else self.kv_dim
        rotary = h / t + kv if self.traits.rotary else 0.0
        attention = 2 * h / t + 2 * kv + rotary + a / t
        return norms + attention + mlp

    def moe_values_per_token(self, mode: Optional[str], tensor: int) -> float:
        """An MoE MLP's saved values per token on a rank (replacing the dense MLP's ``2 g i /
        t``), uniform routing (every token's k rows): the router's logits and scores ``2X``
        (fp32), the k routing weights, the experts' input rows ``k h`` (after the dispatch,
        the rows each local expert multiplies), their SwiGLU hidden ``4 k f / t_e`` (gate,
        SiLU, up, product), the combine's rows at their slots ``k h``; the shared experts as a
        gated MLP ``4 n f_s / t`` and gate ``1``. Under 1D (the tokens whole on every rank) the
        routed part is kept per rank and only the expert width is split (t_e); the sequence
        modes split the tokens: everything ``/ t``."""
        moe, h = self.moe, self.hidden
        seq = splits_sequence(mode)
        t = tensor if mode else 1
        t_e = moe.expert_tensor(mode, t)
        routed = 2 * moe.experts + moe.top_k * (1 + 2 * h + 4 * moe.ffn / t_e)
        shared = 4 * moe.shared / (t if mode == '1d' else 1) + moe.shared_gate
        return (routed + shared) / (t if seq else 1)

    def moe_rows(self, tokens: float) -> float:
        """Rows the MoE layer routes from ``tokens`` tokens, ``N k`` (dropless)."""
        return tokens * self.moe.top_k

    def moe_all_to_all_bytes(self, sent_off: float, received_off: float,
                             elem: int = 4) -> float:
        """One MoE layer's all_to_all buffer bytes per rank over EXPERT, forward + backward of
        one micro-batch, with ``sent_off`` of this rank's kept rows going to experts on other
        ranks and ``received_off`` rows coming from other ranks (``dispatch.exchange_rows``
        moves only those; the own run stays local): the counts ``8 X`` (int64, forward), the
        dispatch ``sent_off`` and the combine ``received_off`` rows of ``h elem`` bytes
        forward, the same two transposed backward: ``8 X + 2 h elem (S_off + R_off)`` in 5
        calls. Uniform routing (:meth:`moe_uniform_off_rows`): ``S_off = R_off = N k (E-1)/E``."""
        return 8 * self.moe.experts + 2 * self.hidden * elem * (sent_off + received_off)

    def moe_uniform_off_rows(self, tokens: float, expert: int) -> float:
        """Rows of ``tokens`` tokens that leave the rank (and as many that arrive) with
        uniform routing over E expert ranks: ``N k (E - 1) / E``."""
        return self.moe_rows(tokens) * (expert - 1) / expert

    def expert_params(self, mode: Optional[str], tensor: int, expert: int) -> float:
        """Expert parameters one rank holds of one MoE block, ``3 X h f / (E t_e)``: the
        part of the block's parameters whose gradients are summed over EXPERT_DATA (data / E)
        and whose ZeRO shards are over it."""
        moe = self.moe
        if moe is None:
            return 0
        t_e = moe.expert_tensor(mode, tensor if mode else 1)
        return 3 * moe.experts * self.hidden * moe.ffn // (expert * t_e)

    def local_kv_width(self, mode: Optional[str], tensor: int) -> float:
        """The k (or v) projection's output width on a rank: ``n_kv d / t``, or ``d`` where
        the family replicates the kv heads (:func:`kv_replicated`: each rank uses the kv
        head its query heads read)."""
        if kv_replicated(mode, tensor, self.kv_heads):
            return self.head_dim
        return self.kv_dim / (tensor if mode else 1)

    def block_comm_bytes(self, mode: Optional[str], p: int, b: float, depth: int = 1,
                         elem: int = 4, ring: int = 1) -> float:
        """``formulas.block_bytes`` generalized to this block (:attr:`block_calls`): one block
        forward + backward on ``b`` sequences (n = b s tokens), buffer bytes per rank over
        the tensor group(s); GPT's block gives ``formulas.block_bytes`` exactly (a test):

        * 1D: an all_reduce of ``n h`` per call (the input gradient of q/k/v and of each MLP
          input projection, o's and the output projection's forward), and where the kv heads
          are replicated (:func:`kv_replicated`) the all_reduce of the full k and v weight
          (and bias) gradients, ``2 (h + bias) n_kv d`` (``GroupedKVLinear1D``);
        * 2D/2.5D (p = d q^2): per call ``2 n out/(d q) + 3 in out/q + [d>1] in out/q^2``,
          with a bias ``+ out/q (1 + [d>1])``; per LayerNorm ``4 n/(d q) + 2 h/q (1 + [d>1])``,
          per RMSNorm half (one statistic, no bias);
        * 3D (p = q^3): ``formulas.linear_3d_bytes`` per call, per LayerNorm
          ``4 n/q^2 + 2h/q``, per RMSNorm half;
        * sequence: ``formulas.ring_attention_bytes`` of the k/v width;
        * ulysses (``ring`` = R, U = p / R): :meth:`ulysses_comm_bytes` summed (the
          all_to_alls over U, the ring over R);
        * None (or p == 1): 0."""
        if mode is None or p == 1:
            return 0
        s, h, calls = self.seq, self.hidden, self.block_calls
        n = b * s
        norm = 0.5 if self.traits.rms_norm else 1.0
        if mode == '1d':
            out = len(calls) * b * s * h * elem
            if self.moe is not None and self.moe.expert_tensor(mode, p) > 1:
                # expert tensor parallelism: the rows the local experts process, R = N k
                # (uniform, dropless), all-reduced over TENSOR forward and backward
                out += 2 * self.moe_rows(n) * h * elem
            if kv_replicated(mode, p, self.kv_heads):
                out += 2 * (h + self.qkv_bias) * self.kv_dim * elem
            return out
        if mode == 'sequence':
            return formulas.ring_attention_bytes(p, b, s, self.kv_dim, elem)
        if mode == 'ulysses':
            return sum(self.ulysses_comm_bytes(p, ring, b, elem))
        if mode in ('2d', '2.5d'):
            q = round((p // depth) ** 0.5)
            deep = 1 if depth > 1 else 0
            elems = sum(2 * n * o / (depth * q) + 3 * i * o / q + deep * i * o / q ** 2
                        + (o / q * (1 + deep) if bias else 0) for i, o, bias in calls)
            elems += 2 * norm * (4 * n / (depth * q) + 2 * h / q * (1 + deep))
            return elem * elems
        if mode == '3d':
            q = round(p ** (1 / 3))
            return (sum(formulas.linear_3d_bytes(b, s, i, o, q, bias=bias, elem=elem)
                        for i, o, bias in calls)
                    + elem * 2 * norm * (4 * n / q ** 2 + 2 * h / q))
        raise ValueError(f'unknown tensor mode {mode!r}')


    def ulysses_comm_bytes(self, p: int, ring: int, b: float, elem: int = 4
                           ) -> Tuple[float, float]:
        """One block's Ulysses attention, forward + backward on ``b`` sequences over P = R x U
        ranks (``ring`` = R): (all_to_all buffer bytes per rank over the U ranks of ULYSSES,
        ``formulas.ulysses_attention_bytes`` = ``2 b (s/P) (2 n + 2 n') d elem``: q, the
        stacked k and v, the output, each forward and backward; bytes each rank sends over
        the R ranks of SEQUENCE_RING, ``formulas.ring_attention_bytes(R, b, s, n' d / U)``,
        0 when R = 1). n' = :func:`ulysses_kv_heads`."""
        u = p // ring
        a2a = formulas.ulysses_attention_bytes(p, u, b, self.seq, self.heads, self.kv_heads,
                                               self.head_dim, elem)
        width = ulysses_kv_heads(self.kv_heads, u) // u * self.head_dim
        ring_bytes = (formulas.ring_attention_bytes(ring, b, self.seq, width, elem)
                      if ring > 1 else 0)
        return a2a, ring_bytes


def splits_sequence(mode: Optional[str]) -> bool:
    """Whether tensor mode ``mode`` keeps every weight whole and splits the activations along
    the sequence over its t ranks ('sequence', 'ulysses': ``TensorFamily.splits_sequence``),
    its parameter gradients summed over data x tensor."""
    return mode is not None and family(mode).splits_sequence


def ulysses_kv_heads(kv_heads: int, ulysses: int) -> int:
    """n': the kv heads Ulysses' all_to_all moves, n_kv where U divides it, else U (fewer
    kv heads than Ulysses ranks are each repeated U / n_kv times first,
    ``nn/sequence/ulysses.py``)."""
    return kv_heads if kv_heads % ulysses == 0 else ulysses


def kv_replicated(mode: Optional[str], tensor: int, kv_heads: int) -> bool:
    """Whether the k/v projections are replicated per group of ranks: the family replicates
    heads it cannot split (``TensorFamily.replicates``: 1D) and its head split does not
    divide ``kv_heads`` (t > n_kv; ``check_layout`` requires n_kv | t then). Every rank
    then holds the full ``[n_kv d, h]`` weights."""
    if mode is None or tensor == 1:
        return False
    fam = family(mode)
    if fam.splits_sequence:   # Ulysses repeats kv heads in flight; its weights are whole
        return False
    return 'head' in fam.replicates and kv_heads % tensor != 0


def layer_params(layers: List[Layer], mode: Optional[str], layout) -> int:
    """Elements one rank holds of ``layers`` under ``layout`` (:func:`param_formulas`)."""
    table = param_formulas(mode, layout)
    return sum(table[kind](**dims) for kind, dims in layers)


def param_formulas(mode: Optional[str], layout) -> dict:
    """``formulas.params`` plus the kinds of the blocks it does not describe: ``rmsnorm(h)``
    (a LayerNorm's weight without its bias: half of ``layernorm``) and
    ``kv_linear(fin, kv_heads, head_dim, bias)`` -- an 'enter' linear to ``n_kv d``, or
    replicated whole, ``(fin + bias) n_kv d``, where :func:`kv_replicated`; an MoE block's
    ``replicated(n)`` (the router, the shared-expert gate: whole on every rank) and
    ``experts(experts, h, f, tensor_parallel)``, the stacked SwiGLU experts ``3 X h f / (E
    t_e)`` (E = ``layout.expert``, t_e :meth:`MoESpec.expert_tensor`)."""
    table = dict(formulas.params(mode, layout))
    layernorm, linear = table['layernorm'], table['linear']

    def kv_linear(fin, kv_heads, head_dim, bias=True):
        if kv_replicated(mode, layout.tensor if mode else 1, kv_heads):
            return (fin + (1 if bias else 0)) * kv_heads * head_dim
        return linear(fin, kv_heads * head_dim, bias, 'enter')
    def experts(experts, h, f, tensor_parallel=None):
        expert = getattr(layout, 'expert', 1)
        t_e = MoESpec(experts, 1, f, tensor_parallel=tensor_parallel).expert_tensor(
            mode, layout.tensor if mode else 1)
        return 3 * experts * h * f // (expert * t_e)
    table.update(rmsnorm=lambda h: layernorm(h) // 2, kv_linear=kv_linear,
                 replicated=lambda n: n, experts=experts)
    return table


def tensor_numels(layers: List[Layer]) -> List[int]:
    """Serial elements of each parameter tensor of ``layers``, in order (a tied weight: none)."""
    out: List[int] = []
    for kind, a in layers:
        if kind == 'linear':
            out += [a['fin'] * a['fout']] + ([a['fout']] if a['bias'] else [])
        elif kind == 'kv_linear':
            width = a['kv_heads'] * a['head_dim']
            out += [a['fin'] * width] + ([width] if a['bias'] else [])
        elif kind == 'layernorm':
            out += [a['h'], a['h']]
        elif kind == 'rmsnorm':
            out.append(a['h'])
        elif kind in ('embedding', 'vocab_embedding'):
            out.append(a['v'] * a['h'])
        elif kind in ('vocab_classifier', 'classifier'):
            out += (([] if a.get('tied') else [a['c'] * a['h']])
                    + ([a['c']] if a.get('bias') else []))
        elif kind == 'replicated':
            out.append(a['n'])
        elif kind == 'experts':
            out += [a['experts'] * a['h'] * a['f']] * 3
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
    fixed by the image)."""
    entry = planner_entry(kind)
    names = entry.shape
    options = entry.options(preset, overrides)
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
    return ModelShape(kind, preset, tuple(sorted((k, _freeze(v)) for k, v in options.items())),
                      int(seq))


class _FrozenDict(dict):
    """A dict option (e.g. a rope scaling) made hashable for ``ModelShape.options``."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _freeze(value):
    if isinstance(value, dict):
        return _FrozenDict((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, dict):
        return {k: _thaw(v) for k, v in value.items()}
    return value


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
