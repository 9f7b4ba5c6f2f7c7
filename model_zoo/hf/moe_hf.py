"""Hugging Face Mixtral and Qwen2-MoE <-> model_zoo Llama with ``moe=dict(...)``.

The attention, norms, embedding and head are Llama's (``llama.py``); only the MLP of the
MoE blocks differs. transformers 5 stores the experts stacked (``MixtralExperts``,
``Qwen2MoeExperts``), as ours do, but as ``nn.functional.linear`` weights (``[out, in]``)
with gate and up fused:

==========================================  ==============================================
ours (``blocks.{i}.mlp.``)                  HF (``model.layers.{i}.mlp.``)
==========================================  ==============================================
``router.weight [X, h]``                    ``gate.weight [X, h]``
``experts.gate [X, h, f]``                  ``experts.gate_up_proj[:, :f, :]`` transposed
``experts.up [X, h, f]``                    ``experts.gate_up_proj[:, f:, :]`` transposed
``experts.down [X, f, h]``                  ``experts.down_proj [X, h, f]`` transposed
``shared_expert.{gate,up,down}_proj``       ``shared_expert.{gate,up,down}_proj`` (Qwen2-MoE)
``shared_expert_gate.weight [1, h]``        ``shared_expert_gate.weight`` (Qwen2-MoE)
==========================================  ==============================================

Config -> ``moe``:

* Mixtral: ``num_local_experts`` -> ``experts``, ``num_experts_per_tok`` -> ``top_k``,
  ``intermediate_size`` -> ``ffn_hidden`` (and ``intermediate``), softmax + top-k
  renormalization (``renormalize=True``); ``router_jitter_noise`` > 0 is refused (ours has
  no jitter).
* Qwen2-MoE: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` ->
  ``ffn_hidden``, ``norm_topk_prob`` -> ``renormalize``, one shared expert of width
  ``shared_expert_intermediate_size`` with its sigmoid gate (``shared_experts=1,
  shared_gate=True``), ``intermediate_size`` the dense blocks' SwiGLU; the dense blocks
  (``mlp_only_layers``, ``decoder_sparse_step``) must be the first n (``first_dense=n``),
  else a ValueError names the fields; ``qkv_bias`` -> ``qkv_bias``.
* Both: the auxiliary loss. HF adds ``router_aux_loss_coef`` x its load-balancing loss only
  with ``output_router_logits=True`` (else none: ``aux_loss_coef=0``), computed once over
  the router logits of all L MoE layers pooled and counting ``f`` per token (k times ours,
  docs/moe.md). Ours sums a per-layer loss over the layers, so ``aux_loss_coef = k *
  router_aux_loss_coef / L``: equal to HF's when every layer routes alike (e.g. uniform
  routing: both give ``k * coef``), close otherwise. ``save_hf`` writes the inverse.

``save_hf`` of a model with ``moe`` writes the HF type it was read from, else Qwen2-MoE
when Mixtral cannot hold it (shared experts, ``renormalize=False``, dense first blocks, q/k/v
biases), else Mixtral. Refused (ValueError naming the option): ``score='sigmoid'``,
``capacity_factor`` (HF is dropless), more than one shared expert or an ungated one in
Qwen2-MoE, and a non-zero balancing bias (``router.balance.bias``: it changes the routing
and HF has no place for it). ``z_loss_coef`` and ``bias_update_rate`` are training
settings HF does not have: not written.
"""
from __future__ import annotations

from typing import Optional

import torch

from .family import State, linear

_ARCH_KEYS = ('experts', 'top_k', 'ffn_hidden', 'first_dense', 'score', 'renormalize',
              'capacity_factor', 'shared_experts', 'shared_ffn_hidden', 'shared_gate')


def _reject(field: str, value, why: str):
    raise ValueError(f'our Llama cannot represent HF {field}={value!r}: {why}')


def _refuse(key: str, value, model_type: str, why: str):
    raise ValueError(f"moe {key}={value!r} cannot be written as HF {model_type!r}: {why}")


def _first_dense(c) -> int:
    """Qwen2-MoE's dense blocks, which must be the first n."""
    step = getattr(c, 'decoder_sparse_step', 1) or 1
    only = set(getattr(c, 'mlp_only_layers', None) or [])
    dense = [i for i in range(c.num_hidden_layers)
             if i in only or c.num_experts == 0 or (i + 1) % step]
    if dense != list(range(len(dense))):
        _reject('mlp_only_layers / decoder_sparse_step', (sorted(only), step),
                f'the dense blocks must be the first n (first_dense=n), HF has {dense}')
    return len(dense)


def moe_kwargs(c) -> dict:
    """Our ``moe`` option from a Mixtral or Qwen2-MoE config (module doc)."""
    if c.model_type == 'mixtral':
        jitter = getattr(c, 'router_jitter_noise', 0.0) or 0.0
        if jitter:
            _reject('router_jitter_noise', jitter, 'ours multiplies no noise into the inputs')
        moe = dict(experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                   ffn_hidden=c.intermediate_size, first_dense=0, renormalize=True)
    else:
        shared = getattr(c, 'shared_expert_intermediate_size', 0) or 0
        if shared <= 0:
            _reject('shared_expert_intermediate_size', shared, 'Qwen2-MoE has a shared expert')
        moe = dict(experts=c.num_experts, top_k=c.num_experts_per_tok,
                   ffn_hidden=c.moe_intermediate_size, first_dense=_first_dense(c),
                   renormalize=bool(c.norm_topk_prob), shared_experts=1,
                   shared_ffn_hidden=shared, shared_gate=True)
    layers = c.num_hidden_layers - moe['first_dense']
    coef = float(getattr(c, 'router_aux_loss_coef', 0.0) or 0.0)
    moe['aux_loss_coef'] = (moe['top_k'] * coef / max(1, layers)
                            if getattr(c, 'output_router_logits', False) else 0.0)
    return moe


def moe_view(moe: Optional[dict], intermediate: int) -> Optional[dict]:
    """The architecture of ``moe`` with the defaults filled in (what must survive a
    write-and-read; the training coefficients left out)."""
    if moe is None:
        return None
    ffn = moe.get('ffn_hidden') or intermediate
    shared = moe.get('shared_experts', 0)
    view = dict(experts=moe['experts'], top_k=moe['top_k'], ffn_hidden=ffn,
                first_dense=moe.get('first_dense', 0), score=moe.get('score', 'softmax'),
                renormalize=moe.get('renormalize', True),
                capacity_factor=moe.get('capacity_factor'), shared_experts=shared,
                shared_ffn_hidden=(moe.get('shared_ffn_hidden') or ffn) if shared else None,
                shared_gate=bool(moe.get('shared_gate')) and bool(shared))
    return {k: view[k] for k in _ARCH_KEYS}


def dense_blocks(args: dict) -> bool:
    """Whether the model has dense SwiGLU blocks (``intermediate`` matters)."""
    moe = args.get('moe')
    return moe is None or moe.get('first_dense', 0) > 0


def moe_model_type(args: dict) -> str:
    """The HF type a model with ``moe`` not read from HF is written as."""
    moe = args['moe']
    needs_qwen = (moe.get('shared_experts') or args.get('qkv_bias')
                  or not moe.get('renormalize', True) or moe.get('first_dense'))
    return 'qwen2_moe' if needs_qwen else 'mixtral'


def moe_config(model_type: str, args: dict) -> dict:
    """The HF config fields of ``args['moe']`` for ``model_type`` (module doc)."""
    moe = args['moe']
    view = moe_view(moe, args['intermediate'])
    if view['score'] != 'softmax':
        _refuse('score', view['score'], model_type, 'HF routes by softmax scores')
    if view['capacity_factor'] is not None:
        _refuse('capacity_factor', view['capacity_factor'], model_type,
                'HF MoE layers are dropless')
    layers = args['layers'] - view['first_dense']
    aux = float(moe.get('aux_loss_coef', 0.0) or 0.0)
    out = dict(num_experts_per_tok=view['top_k'], output_router_logits=aux > 0,
               router_aux_loss_coef=aux * layers / view['top_k'] if aux > 0 else 0.001)
    if model_type == 'mixtral':
        for key, bad, why in (('shared_experts', view['shared_experts'], 'no shared experts'),
                              ('renormalize', not view['renormalize'],
                               'the top-k weights always renormalized'),
                              ('first_dense', view['first_dense'], 'every block MoE')):
            if bad:
                _refuse(key, view[key], model_type, f'Mixtral has {why}')
        out.update(num_local_experts=view['experts'], intermediate_size=view['ffn_hidden'],
                   router_jitter_noise=0.0)
        return out
    if view['shared_experts'] != 1 or not view['shared_gate']:
        _refuse('shared_experts', (view['shared_experts'], view['shared_gate']), model_type,
                'Qwen2-MoE has exactly one shared expert, gated (shared_experts=1, '
                'shared_gate=True)')
    out.update(num_experts=view['experts'], moe_intermediate_size=view['ffn_hidden'],
               shared_expert_intermediate_size=view['shared_ffn_hidden'],
               norm_topk_prob=view['renormalize'], decoder_sparse_step=1,
               mlp_only_layers=list(range(view['first_dense'])))
    return out


def moe_renames(moe: dict):
    """(our key, HF key) pairs of an MoE block's renamed tensors, relative to the block."""
    out = [('mlp.router.weight', 'mlp.gate.weight')]
    if moe.get('shared_experts'):
        for name in ('gate', 'up', 'down'):
            out += linear(f'mlp.shared_expert.{name}_proj', f'mlp.shared_expert.{name}_proj',
                          bias=False)
        if moe.get('shared_gate'):
            out.append(('mlp.shared_expert_gate.weight', 'mlp.shared_expert_gate.weight'))
    return out


def experts_to_ours(hf, hf_prefix: str, ours: str) -> State:
    """Our stacked ``gate``, ``up``, ``down`` from HF's ``gate_up_proj`` / ``down_proj``."""
    gate_up = hf[hf_prefix + 'gate_up_proj']
    f = gate_up.shape[1] // 2
    return {ours + 'gate': gate_up[:, :f].transpose(1, 2).contiguous(),
            ours + 'up': gate_up[:, f:].transpose(1, 2).contiguous(),
            ours + 'down': hf[hf_prefix + 'down_proj'].transpose(1, 2).contiguous()}


def experts_to_hf(state: State, ours: str, hf_prefix: str) -> State:
    """HF's ``gate_up_proj`` / ``down_proj`` from our stacked experts; a non-zero balancing
    bias beside them is refused (module doc)."""
    bias_key = ours[:-len('experts.')] + 'router.balance.bias'
    if bias_key in state and bool(state[bias_key].abs().max() > 0):
        raise ValueError(f'{bias_key} is non-zero: the balancing bias changes which experts '
                         f'a token picks, and HF Mixtral / Qwen2-MoE have no place for it')
    gate_up = torch.cat([state[ours + 'gate'].transpose(1, 2),
                         state[ours + 'up'].transpose(1, 2)], dim=1)
    return {hf_prefix + 'gate_up_proj': gate_up.contiguous(),
            hf_prefix + 'down_proj': state[ours + 'down'].transpose(1, 2).contiguous()}
