"""Models that build only their pipeline stages: :class:`StagedModel`.

A staged model is ``first part -> n blocks -> last part``. Built under a layout with
pipeline size P and V chunks per rank (``parallel.pipeline``), it cuts the blocks into
S = P*V stages (``partition.py``) and keeps only the blocks of this rank's stages, under
their serial names (``blocks.<i>``), plus the first part on the rank of stage 0 and the
last part on the rank of stage S-1. Weights are drawn by serial name (``tensor/init.py``),
so every stage holds exactly the serial model's weights.

Building neither times nor communicates: ``partition='cost'`` reads a cut that the explicit
step :func:`resolve_partition` (after launch, collective) measured and agreed beforehand.

``forward(*inputs, stage_input=None, stage=None)`` runs one stage: stage 0 starts from the
user's inputs, a later stage from ``stage_input`` (the previous stage's activation) -- the
user's inputs (masks, ids) are still passed, since every rank has the micro-batch. Stage
S-1 returns the model's output, others the activation. Without pipelining there is one
stage and ``forward(*inputs)`` is the whole model.

``state_dict()`` holds this rank's parameters with serial keys; ``load_state_dict(full)``
takes its own keys from a full serial dict and ignores the other stages' keys (a key of
this rank missing from it is still an error under ``strict``).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Hashable, List, Mapping, Optional, Tuple

from torch import nn

from ..communication import collective as C
from ..config import parse_parallel
from ..context import ParallelContext, ParallelMode, current_context, use_context
from ..tensor import init_by_name
from ..tensor.placement import param_placement, set_placement
from .partition import StageSpec, balanced_cut, cut, explicit_cut, rank_stages

# weights(method) -> (first part, block weight or one weight per block, last part)
Weights = Callable[[str], Tuple[float, object, float]]


def my_stages(num_layers: int, weights: Optional[Weights] = None,
              cost_key: Optional[Hashable] = None) -> List[StageSpec]:
    """This rank's stages for a model of ``num_layers`` blocks under the current context;
    neither times nor communicates.

    ``weights('parameters')`` gives ``(first, block, last)`` parameter counts for the
    ``parameters`` partition; ``partition='cost'`` takes the cut :func:`resolve_partition`
    stored on the context under ``cost_key`` (:func:`partition_key`; a ValueError naming that
    step when it has not run); an explicit partition (a tuple of blocks per stage) is taken
    as is (a ValueError unless it sums to ``num_layers``)."""
    settings = current_context().pipeline
    size = settings.size
    if isinstance(settings.partition, tuple):  # an explicit cut: blocks per stage
        return _rank_stages(explicit_cut(settings.partition, num_layers), size)
    if settings.stages == 1:
        return [StageSpec(0, 1, range(num_layers))]
    if num_layers < settings.stages:
        raise ValueError(f'model.layers = {num_layers} is fewer than the pipeline stages '
                         f'(pipeline size {size} x chunks {settings.chunks} = '
                         f'{settings.stages}): every stage needs at least one layer')
    if settings.partition == 'cost':
        ranges = explicit_cut(_resolved_cut(cost_key), num_layers)
    elif settings.partition == 'parameters':
        if weights is None:
            raise ValueError("partition 'parameters' needs the model's layer weights")
        first, block, last = weights('parameters')
        blocks = list(block) if isinstance(block, (list, tuple)) else [block] * num_layers
        ranges = balanced_cut(blocks, settings.stages, first, last)
    else:
        ranges = cut('uniform', num_layers, settings.stages)
    return _rank_stages(ranges, size)


def _rank_stages(ranges: List[range], size: int) -> List[StageSpec]:
    return rank_stages(ranges, size, current_context().axis(ParallelMode.PIPELINE).rank)


def _arguments(model_cls, options: Mapping[str, Any]) -> dict:
    """``model_cls``'s constructor arguments for ``options``, defaults filled in."""
    args = inspect.signature(model_cls).bind(**options)
    args.apply_defaults()
    return dict(args.arguments)


def partition_key(model_cls, options: Mapping[str, Any]) -> Hashable:
    """What a measured cut depends on: the pipeline's stage count, the model class and its
    constructor arguments (``options`` with the defaults filled in), less the class's
    ``untimed_options`` (those the timing fixes, e.g. dropout)."""
    untimed = getattr(model_cls, 'untimed_options', ())
    kept = sorted((k, v) for k, v in _arguments(model_cls, options).items() if k not in untimed)
    return (current_context().pipeline.stages, f'{model_cls.__module__}.{model_cls.__qualname__}',
            repr(kept))


def _resolved_cut(key: Optional[Hashable]) -> Tuple[int, ...]:
    cuts = current_context().partition_cuts
    if key is None:
        raise ValueError("partition 'cost' is not available for this model (it cannot time its "
                         "parts); use 'uniform', 'parameters' or an explicit list of blocks per "
                         "stage")
    if key not in cuts:
        raise ValueError(f"partition 'cost' cuts {key[1]} by measured times, which are agreed "
                         f"before the model is built: call colossal_lite.pipeline."
                         f"resolve_partition(<model class>, **<its options>) once on every rank "
                         f"after launch (colossal-lite train and job.describe_model do it), then "
                         f"build the model")
    return cuts[key]


def resolve_partition(model_cls, **options) -> Optional[Tuple[int, ...]]:
    """The explicit partition step: run it after launch and before building a model whose
    config says ``parallel.pipeline.partition='cost'``; elsewhere it does nothing and returns
    None (the other partitions need neither timing nor communication).

    ``model_cls(**options)`` is the model about to be built; the class times its parts with
    ``model_cls.part_costs(args)`` -> (first part, one block, last part) seconds, ``args``
    its constructor arguments with defaults (model_zoo's GPT, BERT and ViT: a 3-block copy
    timed as a described 3-stage pipeline, ``measure_part_costs``). The ranks agree on the
    maximum of their measurements (**collective**: one MAX all_reduce over GLOBAL when
    launched, so every rank calls it, for the same models in the same order), cut the
    ``model_cls.blocks_option`` blocks (default ``layers``) into P*V stages minimizing the
    heaviest one (``partition.balanced_cut``) and keep the cut on the current context
    (``partition_cuts``), where the constructor reads it. Returns the cut, blocks per stage
    (a second call for the same model returns it without measuring)."""
    settings = current_context().pipeline
    if settings.partition != 'cost' or settings.stages == 1:
        return None
    key = partition_key(model_cls, options)
    cuts = current_context().partition_cuts
    if key not in cuts:
        if not hasattr(model_cls, 'part_costs'):
            raise ValueError(f"partition 'cost' needs a model class that times its parts "
                             f"(part_costs); {model_cls!r} does not: use 'uniform', "
                             f"'parameters' or an explicit list of blocks per stage")
        args = _arguments(model_cls, options)
        layers = args[getattr(model_cls, 'blocks_option', 'layers')]
        first, block, last = _agreed([float(c) for c in model_cls.part_costs(args)])
        ranges = balanced_cut([block] * layers, settings.stages, first, last)
        cuts[key] = tuple(len(r) for r in ranges)
    return cuts[key]


def _agreed(values: List[float]) -> List[float]:
    """The maximum of every rank's values (measured costs differ from rank to rank; every
    rank must cut the model alike): one MAX all_reduce over GLOBAL when launched."""
    ctx = current_context()
    if ctx.is_described or ctx.axis(ParallelMode.GLOBAL).size == 1:
        return values
    import torch
    import torch.distributed as dist
    out = C.all_reduce(torch.tensor(values, dtype=torch.float64, device=ctx.device),
                       ParallelMode.GLOBAL, op=dist.ReduceOp.MAX)
    return [float(v) for v in out.cpu()]


def measure_part_costs(build: Callable[[], nn.Module], sample: Callable[[], tuple],
                       repeats: int = 3) -> Tuple[float, float, float]:
    """(first part, one block, last part) forward+backward seconds on this CPU.

    ``build()`` makes the model with 3 blocks, ``sample()`` small inputs for it (both are
    called on the CPU device, even inside a meta build); the model is built for real as the
    three stages of a described 3-stage pipeline -- first part + block, block, block + last
    part -- and each stage is timed (median of ``repeats`` after a warm-up), so
    ``first = t0 - t1``, ``block = t1``, ``last = t2 - t1`` (clamped at 0)."""
    import torch
    layout = parse_parallel({'pipeline': 3}).with_world_size(3)
    with torch.device('cpu'):
        return _time_stages(build, sample(), layout, repeats)


def _time_stages(build, inputs, layout, repeats):
    import statistics
    import time
    stages = []
    for rank in range(3):
        with use_context(ParallelContext.describe(layout, rank)):
            stages.append(build())
    times = []
    for _ in range(repeats + 1):
        x, row = None, []
        for model in stages:
            start = time.perf_counter()
            out = model(*inputs, stage_input=x)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            sum(o.float().sum() for o in outs).backward()
            row.append(time.perf_counter() - start)
            x = outs[0].detach().requires_grad_(True)
        times.append(row)
    t0, t1, t2 = (statistics.median(col) for col in zip(*times[1:]))
    return max(t0 - t1, 0.0), t1, max(t2 - t1, 0.0)


class StagedModel(nn.Module):
    """Mixin for models cut into pipeline stages (module doc).

    A subclass that supports ``partition='cost'`` defines the classmethod
    ``part_costs(args) -> (first, block, last)`` seconds (``args``: its constructor arguments;
    see :func:`resolve_partition`) and may name the constructor option counting its blocks
    (``blocks_option``) and the options its timing fixes (``untimed_options``)."""

    stages: List[StageSpec]
    blocks_option: str = 'layers'
    untimed_options: Tuple[str, ...] = ()

    def plan_stages(self, num_layers: int, weights: Optional[Weights] = None,
                    options: Optional[Mapping[str, Any]] = None):
        """Decide this rank's stages (``self.stages``); call before building any part.
        ``options``: the constructor's arguments, naming the cut :func:`resolve_partition`
        stored for ``partition='cost'``. No timing, no communication."""
        cost = options is not None and current_context().pipeline.partition == 'cost'
        key = partition_key(type(self), options) if cost else None
        self.stages = my_stages(num_layers, weights, key)
        self.num_stages = self.stages[0].count

    def build_blocks(self, make_block: Callable[[int], nn.Module]) -> nn.ModuleDict:
        """The blocks of this rank's stages as a ModuleDict keyed by serial index (so their
        names are ``<attr>.<i>``, as in an ``nn.ModuleList``)."""
        return nn.ModuleDict({str(i): make_block(i) for spec in self.stages for i in spec.layers})

    @property
    def holds_first(self) -> bool:
        return any(spec.first for spec in self.stages)

    @property
    def holds_last(self) -> bool:
        return any(spec.last for spec in self.stages)

    @property
    def is_pipelined(self) -> bool:
        return self.num_stages > 1

    def stage_spec(self, stage: Optional[int] = None) -> StageSpec:
        if stage is None:
            if len(self.stages) != 1:
                raise ValueError(f'this rank holds stages {[s.index for s in self.stages]}; '
                                 f'pass stage= to run one of them')
            return self.stages[0]
        for spec in self.stages:
            if spec.index == stage:
                return spec
        raise ValueError(f'stage {stage} is not held by this rank (it holds '
                         f'{[s.index for s in self.stages]})')

    def stage_start(self, spec: StageSpec, stage_input):
        """Check that a stage gets an activation exactly when it is not the first."""
        if spec.first and stage_input is not None:
            raise ValueError('stage 0 starts from the inputs; got a stage_input')
        if not spec.first and stage_input is None:
            raise ValueError(f'stage {spec.index} of {spec.count} needs stage_input, the '
                             f'activation of stage {spec.index - 1}')
        return stage_input

    @staticmethod
    def positions(input_ids, max_positions: int):
        """Position ids ``[b, s]`` for ``input_ids [b, s]``; a ValueError past ``max_positions``."""
        import torch
        b, s = input_ids.shape
        if s > max_positions:
            raise ValueError(f'sequence length {s} exceeds max_positions {max_positions}')
        return torch.arange(s, device=input_ids.device).expand(b, s)

    def tie_across_stages(self, name: str):
        """Declare parameter ``name`` held by both the first and the last stage (a tied
        embedding): under pipeline parallelism its placement's ``grad_sum`` gains EMBEDDING,
        so the engine sums its gradient over the first and last stage and the clipping norm
        counts it once. Call after the weights are materialized."""
        if current_context().axis(ParallelMode.PIPELINE).size == 1:
            return
        params = dict(self.named_parameters())
        if name not in params:
            return  # a middle stage holds no copy
        param = params[name]
        placement = param_placement(param)
        if ParallelMode.EMBEDDING not in placement.grad_sum:
            set_placement(param, dataclasses.replace(
                placement, grad_sum=placement.grad_sum + (ParallelMode.EMBEDDING,)))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.is_pipelined:
            own = set(self.state_dict_keys())
            state_dict = {k: v for k, v in state_dict.items() if k in own}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def state_dict_keys(self) -> List[str]:
        """This rank's state-dict keys (no communication)."""
        keys = [name for name, _ in self.named_parameters(remove_duplicate=False)]
        return keys + [name for name, _ in self.named_buffers()]


def transformer_weights(hidden: int, mlp_ratio: int, first_params: int, last_params: int
                        ) -> Weights:
    """``weights('parameters')`` for a pre/post-LN transformer: parameter counts of a block
    ((4 + 2r) h^2 + (9 + r) h), the first and last parts."""
    block = (4 + 2 * mlp_ratio) * hidden ** 2 + (9 + mlp_ratio) * hidden
    return parameter_weights(first_params, block, last_params)


def parameter_weights(first_params: int, block_params: int, last_params: int) -> Weights:
    """``weights('parameters')``: the parameter counts of the first part, one block and the
    last part (a ValueError for any other partition method)."""
    def weights(method: str) -> Tuple[float, float, float]:
        if method != 'parameters':
            raise ValueError(f"partition {method!r} has no parameter weights")
        return float(first_params), float(block_params), float(last_params)
    return weights


class StagedSequential(StagedModel):
    """A user model given as a list of layer builders, cut into pipeline stages.

    ``StagedSequential([lambda: nn.Linear(8, 8), ...])``: this rank builds only the layers of
    its stages, named ``layers.<i>`` as in ``nn.Sequential``-like serial code, inside
    ``init_by_name`` (so layers made of ``colossal_lite.nn`` facades get the serial weights;
    plain torch layers are reset by their name). ``forward(x)`` on stage 0,
    ``forward(stage_input=h)`` later; each layer maps one tensor to one tensor.
    ``partition='parameters'`` weighs each layer by its parameter count (built on meta)."""

    def __init__(self, builders):
        super().__init__()
        builders = list(builders)
        if not builders:
            raise ValueError('StagedSequential needs at least one layer builder')

        def weights(method: str):
            if method != 'parameters':
                raise ValueError(f"StagedSequential supports partition 'uniform' or "
                                 f"'parameters', got {method!r}")
            import torch
            with torch.device('meta'):
                counts = [float(sum(p.numel() for p in b().parameters())) for b in builders]
            return 0.0, counts, 0.0
        with init_by_name(self):
            self.plan_stages(len(builders), weights)
            self.layers = self.build_blocks(lambda i: builders[i]())

    def forward(self, x=None, stage_input=None, stage: Optional[int] = None):
        spec = self.stage_spec(stage)
        h = x if spec.first else self.stage_start(spec, stage_input)
        for i in spec.layers:
            h = self.layers[str(i)](h)
        return h
