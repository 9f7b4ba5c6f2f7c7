"""The model registry: what a config's ``model=dict(type=NAME, preset=..., **options)`` builds.

The library never imports a model package itself. A package of models registers them
when it is imported::

    from colossal_lite.models import ModelTraits, PlannerShape, SizeRule, register_model
    register_model('my_lm', MyLM, presets=MY_PRESETS, loss=MyLMLoss, data='shakespeare',
                   rules=lambda o: [SizeRule('model.heads', o['heads'], 'head'), ...],
                   shape=PlannerShape(), traits=ModelTraits(causal=True, tied_head=True))

and the job finds it in one of two ways:

* the config's top-level ``imports=['my_models']`` (modules imported before the job is
  parsed; a config file's own directory is searched too) -- the path for user models and
  for running from a source tree that is not installed;
* the setuptools entry-point group ``colossal_lite.models`` (``setup.py`` declares the
  repository's model zoo there), loaded the first time a name is not yet registered.

A model's options are its preset's values updated by the config's other ``model`` keys;
an option is legal when the preset has it or the builder takes it as a keyword.

An entry may also describe itself to the planner (``colossal_lite.auto``), which reads a
model only through that description and never by its name: ``shape`` (a
:class:`PlannerShape`: which options hold its sizes) and ``traits`` (a :class:`ModelTraits`:
the structure its parameter, FLOP and memory formulas depend on); ``hf`` (an
:class:`HFAdapter`) names its Hugging Face conversion and ``profile=True`` marks the model
whose blocks ``python -m colossal_lite.auto.profile`` times.

One type is built in: ``model=dict(type='hf', config=dict(model_type='llama', ...))`` (a
random-init ``transformers`` causal LM) or ``dict(type='hf', path=DIR)`` (a local
checkpoint, ``from_pretrained(local_files_only=True)``): :class:`HFCausalLM`, whose forward
returns its own next-token loss (criterion :class:`ModelLoss`). It trains data parallel
or under ``parallel.auto`` (``auto.parallelize`` plans it op by op).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch

ENTRY_POINT_GROUP = 'colossal_lite.models'
SPLITS = ('head', 'hidden', 'vocab', 'sequence', 'batch')  # TensorFamily.<kind>_split
INPUTS = ('tokens', 'images')   # ModelTraits.inputs


@dataclass(frozen=True)
class SizeRule:
    """The config key ``key`` holds (or determines) ``value``, which must be divisible by
    ``by``: an int (``by_key`` names where it comes from) or a split of the layout's tensor
    family, one of :data:`SPLITS` (``families.family(mode).<by>_split(layout)``).
    ``or_divides``: where the family replicates what that split cannot cut
    (``TensorFamily.replicates``, e.g. 1D's grouped-query kv heads), ``value`` dividing the
    split is accepted too."""

    key: str
    value: int
    by: Union[int, str]
    by_key: str = ''
    what: str = ''
    or_divides: bool = False

    def __post_init__(self):
        if isinstance(self.by, str) and self.by not in SPLITS:
            raise ValueError(f'SizeRule.by must be an int or one of {SPLITS}, got {self.by!r}')


@dataclass(frozen=True)
class PlannerShape:
    """Where the planner finds a model's sizes: each field names the option that holds one
    (None: the model has no such size). An option missing from the resolved options takes
    the builder's keyword default.

    ``layers`` blocks, ``hidden`` width h, ``heads`` attention (query) heads; ``kv_heads``
    key/value heads (grouped-query attention; None: as many as ``heads``); ``ffn`` the MLP's
    inner width (None: ``mlp_ratio`` x h); ``vocab`` token-embedding rows (None: no token
    input); ``seq`` the longest sequence, the planner's default sequence length;
    ``positions`` rows of a learned position embedding (None: none, e.g. rotary);
    ``segments`` rows of a token-type embedding; ``classes`` a classifier head's outputs
    (None: the head predicts the vocabulary); ``image`` / ``patch`` / ``channels`` an image
    input's side, patch side and channels (a patch embedding: 1 class token +
    (image / patch)^2 tokens, which fix the sequence); ``pair_head`` a flag option adding a
    pooled two-way classifier on the first token (a pooler linear, then 2 outputs: a
    next-sentence head). ``blocks`` is the attribute holding the built blocks (the
    ``StagedModel.build_blocks`` ModuleDict, keyed by serial index). ``tie_head`` a flag
    option tying the head to the token embedding (None: ``ModelTraits.tied_head`` says);
    ``qkv_bias`` a flag option giving the q/k/v projections biases (None:
    ``ModelTraits.linear_bias`` says). ``moe`` the option holding a mixture-of-experts dict
    (``experts``, ``top_k``, ``ffn_hidden``, ``first_dense``, ``shared_experts``,
    ``shared_ffn_hidden``, ``shared_gate``, ``expert_tensor_parallel``; None or an unset
    option: a dense model): the blocks from ``first_dense`` on have an MoE MLP of SwiGLU
    experts (docs/moe.md), which the planner costs with expert parallelism."""

    layers: str = 'layers'
    hidden: str = 'hidden'
    heads: str = 'heads'
    kv_heads: Optional[str] = None
    ffn: Optional[str] = None
    mlp_ratio: Optional[str] = 'mlp_ratio'
    vocab: Optional[str] = 'vocab_size'
    seq: Optional[str] = 'max_positions'
    positions: Optional[str] = 'max_positions'
    segments: Optional[str] = None
    classes: Optional[str] = None
    image: Optional[str] = None
    patch: Optional[str] = None
    channels: Optional[str] = None
    pair_head: Optional[str] = None
    blocks: str = 'blocks'
    tie_head: Optional[str] = None
    qkv_bias: Optional[str] = None
    moe: Optional[str] = None

    def __post_init__(self):
        image = (self.image, self.patch, self.channels)
        if any(image) and not all(image):
            raise ValueError(f'PlannerShape: an image input names image, patch and channels, '
                             f'got {image}')
        if self.vocab is None and self.image is None:
            raise ValueError('PlannerShape: the model needs a token input (vocab) or an '
                             'image input (image, patch, channels)')
        if self.vocab is None and self.classes is None:
            raise ValueError('PlannerShape: a model without a vocabulary needs a classifier '
                             'head (classes)')


@dataclass(frozen=True)
class ModelTraits:
    """The structure behind a model's parameter, FLOP and memory formulas (its blocks are
    attention + MLP with a LayerNorm each; the defaults: a pre-LN model on tokens with an
    untied, bias-free head on every token).

    ``inputs``: 'tokens' or 'images' (what the planner's job feeds it); ``causal``: causal
    attention (a causal mask; the planner's formulas do not depend on it);
    ``causal_mask``: each block's attention builds an s x s mask and saves it for backward;
    ``final_norm``: a LayerNorm between the last block and the head (pre-LN);
    ``embedding_norm``: a LayerNorm after the embeddings (post-LN); ``head_transform``: a
    transform before the head (masked-LM: dense, GELU, LayerNorm); ``head_per_token``: the
    head runs on every token (a language model) or on one (a classifier on the class
    token); ``head_bias``: the head has a bias; ``tied_head``: the head's weight is the
    token embedding's (a pipelined model's last stage holds a copy); ``gated_mlp``: the MLP
    has two input projections (SwiGLU: ``down(silu(gate(x)) * up(x))``); ``rms_norm``: the
    norms are RMSNorm (a weight, no bias, no centering); ``linear_bias``: the block's
    linears have biases; ``rotary``: q and k are rotated by position (RoPE: no parameters;
    its elementwise FLOPs are not counted)."""

    inputs: str = 'tokens'
    causal: bool = False
    causal_mask: bool = False
    final_norm: bool = True
    embedding_norm: bool = False
    head_transform: bool = False
    head_per_token: bool = True
    head_bias: bool = False
    tied_head: bool = False
    gated_mlp: bool = False
    rms_norm: bool = False
    linear_bias: bool = True
    rotary: bool = False

    def __post_init__(self):
        if self.inputs not in INPUTS:
            raise ValueError(f'ModelTraits.inputs must be one of {INPUTS}, got {self.inputs!r}')


@dataclass(frozen=True)
class HFAdapter:
    """A registered model's Hugging Face conversion: ``from_hf(path_or_model, **overrides)``
    builds it for the launched layout with a transformers model's weights;
    ``save_hf(model, directory)`` (collective) writes a directory transformers loads."""

    from_hf: Callable[..., Any]
    save_hf: Callable[[Any, Any], None]


@dataclass(frozen=True)
class ModelEntry:
    """One registered model: ``builder(**options)`` builds it (for the current context),
    ``loss()`` its training criterion; ``data`` the bundled data set a job trains it on
    (None: none); ``rules(options)`` the sizes a layout must divide; ``layers`` the option
    counting its transformer blocks (what a pipeline cuts). For the planner: ``shape``
    (None: the planner cannot describe it) and ``traits``; ``hf`` its Hugging Face
    conversion (None: none); ``profile``: the model ``auto.profile`` times (a causal token
    model taking ``vocab_size``, ``max_positions``, ``hidden``, ``heads``, ``layers`` and
    ``dropout``; one entry at most). ``check(options, layout)``: further checks of the
    options against the layout (``layout.expert``, ...) raising a ConfigError that names the
    key, run by ``colossal-lite train`` before any worker starts (None: none)."""

    name: str
    builder: Callable[..., Any]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    loss: Optional[Callable[[], Any]] = None
    data: Optional[str] = None
    rules: Optional[Callable[[Mapping[str, Any]], Sequence[SizeRule]]] = None
    layers: Optional[str] = 'layers'
    label: str = ''
    shape: Optional[PlannerShape] = None
    traits: ModelTraits = ModelTraits()
    hf: Optional[HFAdapter] = None
    profile: bool = False
    check: Optional[Callable[[Mapping[str, Any], Any], None]] = None

    def __post_init__(self):
        if self.shape is not None and self.shape.layers != self.layers:
            raise ValueError(f"model '{self.name}': the planner shape counts blocks in option "
                             f"{self.shape.layers!r}, the entry in {self.layers!r}")

    def option(self, options: Mapping[str, Any], name: str) -> Any:
        """Option ``name`` of resolved ``options``, else the builder's keyword default;
        KeyError when it has neither."""
        if name in options:
            return options[name]
        default = _defaults(self.builder).get(name, inspect.Parameter.empty)
        if default is inspect.Parameter.empty:
            raise KeyError(f"model '{self.name}' has no option {name!r} and its builder no "
                           f"default for it")
        return default

    def options(self, preset: Optional[str], overrides: Mapping[str, Any]) -> Dict[str, Any]:
        """The preset's options updated by ``overrides``; ValueError on an unknown preset
        or option."""
        label = self.label or self.name.upper()
        if preset is None:
            base = {}
        elif preset in self.presets:
            base = dict(self.presets[preset])
        else:
            raise ValueError(f"unknown {label} preset '{preset}'; presets: {sorted(self.presets)}")
        known = set(base) | _keywords(self.builder)
        unknown = set(overrides) - known
        if unknown and not _takes_any_keyword(self.builder):
            raise ValueError(f'unknown {label} options {sorted(unknown)}; options: {sorted(known)}')
        base.update(overrides)
        return base

    def size_rules(self, options: Mapping[str, Any]) -> Sequence[SizeRule]:
        return list(self.rules(options)) if self.rules else []


_REGISTRY: Dict[str, ModelEntry] = {}
_entry_points_loaded = False


def register_model(name: str, builder: Callable[..., Any], presets: Optional[Mapping] = None,
                   loss: Optional[Callable[[], Any]] = None, data: Optional[str] = None,
                   rules: Optional[Callable] = None, layers: Optional[str] = 'layers',
                   label: str = '', replace: bool = False, *,
                   shape: Optional[PlannerShape] = None, traits: Optional[ModelTraits] = None,
                   hf: Optional[HFAdapter] = None, profile: bool = False,
                   check: Optional[Callable] = None) -> ModelEntry:
    """Make ``model=dict(type=name, ...)`` build ``builder(**options)``; see :class:`ModelEntry`.
    Registering a taken name with another builder needs ``replace=True``."""
    entry = ModelEntry(name, builder, dict(presets or {}), loss, data, rules, layers, label,
                       shape, traits or ModelTraits(), hf, profile, check)
    old = _REGISTRY.get(name)
    if old is not None and old.builder is not builder and not replace:
        raise ValueError(f"model name '{name}' is already registered to {old.builder!r}; "
                         f"pass replace=True to replace it")
    _REGISTRY[name] = entry
    return entry


def unregister_model(name: str):
    _REGISTRY.pop(name, None)


def get_model(name: str) -> ModelEntry:
    """The entry registered as ``name`` (entry points loaded on the first miss)."""
    if name not in _REGISTRY:
        load_entry_points()
    if name not in _REGISTRY:
        raise ValueError(f'{name!r} is not a registered model; registered: {registered_models()} '
                         f"(a module named in the config's 'imports' or an entry point of group "
                         f"'{ENTRY_POINT_GROUP}' registers models with register_model)")
    return _REGISTRY[name]


def registered_models() -> list:
    return sorted(_REGISTRY)


def load_entry_points():
    """Import every module of the entry-point group ``colossal_lite.models`` (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import distributions
    seen = set()
    for dist in distributions():  # every copy of a distribution's metadata (not only the first
        for point in dist.entry_points:  # on sys.path: a stale source-tree egg-info may shadow)
            if point.group == ENTRY_POINT_GROUP and point.value not in seen:
                seen.add(point.value)
                point.load()


def import_modules(names: Sequence[str]):
    """Import each named module (the config's ``imports``); ValueError naming a failure."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f'could not import {name!r}: {type(err).__name__}: {err}') from err


def _defaults(fn) -> Dict[str, Any]:
    """The keyword defaults of ``fn`` (a class: of its constructor); read, never modify."""
    try:
        return _hashable_defaults(fn)
    except TypeError:   # an unhashable callable: not cached
        return _hashable_defaults.__wrapped__(fn)


@functools.lru_cache(maxsize=None)
def _hashable_defaults(fn) -> Dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not p.empty}


def _keywords(fn) -> set:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _takes_any_keyword(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind == p.VAR_KEYWORD for p in params)


# ---------------------------------------------------------------------------- built in: 'hf'
HF_MODEL = 'hf'


class HFCausalLM(torch.nn.Module):
    """A ``transformers`` causal LM trained on its own ids: ``forward(ids)`` is the mean
    next-token loss (``labels=ids``, shifted inside the model)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


class ModelLoss(torch.nn.Module):
    """The criterion of a model whose output is its loss: ``forward(output, *labels)``
    returns ``output``."""

    def forward(self, output, *labels):
        return output


def hf_config(config: Optional[Mapping[str, Any]] = None, path: Optional[str] = None):
    """The ``transformers`` config of ``model=dict(type='hf', ...)``: ``config`` (a dict
    with ``model_type`` and the config's fields) or ``path`` (a local directory with
    ``config.json``), exactly one; ValueError naming the key otherwise."""
    from transformers import AutoConfig
    if (config is None) == (path is None):
        raise ValueError("'model' of type 'hf' needs exactly one of 'model.config' "
                         "(dict(model_type='llama', ...)) and 'model.path' (a local Hugging "
                         f"Face directory), got config={config!r}, path={path!r}")
    if path is not None:
        if not isinstance(path, str) or not os.path.isfile(os.path.join(path, 'config.json')):
            raise ValueError(f"'model.path' = {path!r} is not a directory holding a Hugging "
                             f"Face config.json")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if not isinstance(config, Mapping) or not isinstance(config.get('model_type'), str):
        raise ValueError(f"'model.config' must be a dict with a 'model_type' "
                         f"(e.g. dict(model_type='llama', hidden_size=64, ...)), got {config!r}")
    fields = {k: v for k, v in config.items() if k != 'model_type'}
    try:
        return AutoConfig.for_model(config['model_type'], **fields)
    except (ValueError, TypeError) as err:
        raise ValueError(f"'model.config': {err}") from None


def hf_sizes(config) -> Dict[str, Optional[int]]:
    """``vocab`` and ``positions`` (None: no limit, e.g. rotary only) of a transformers
    config, for the job's checks."""
    positions = getattr(config, 'max_position_embeddings', None) \
        or getattr(config, 'n_positions', None)
    return dict(vocab=getattr(config, 'vocab_size', None), positions=positions)


def hf_causal_lm(config: Optional[Mapping[str, Any]] = None,
                 path: Optional[str] = None) -> HFCausalLM:
    """:class:`HFCausalLM` of ``AutoModelForCausalLM.from_config`` (random init from the
    default generator: the same seed builds the same weights on every rank) or
    ``from_pretrained(path, local_files_only=True)``; float32. Under ``torch.device('meta')``
    (the job's pre-start check) only the config is read."""
    from transformers import AutoModelForCausalLM
    cfg = hf_config(config, path)
    if path is not None and not torch.empty(0).is_meta:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    return HFCausalLM(model.float())


register_model(HF_MODEL, hf_causal_lm, loss=ModelLoss, data='shakespeare', layers=None,
               label='HF')
