"""Models that build only their pipeline stages: :class:`StagedModel`.

A staged model is ``first part -> n blocks -> last part``. Built under a layout with
pipeline size P and V chunks per rank (``parallel.pipeline``), it cuts the blocks into
S = P*V stages (``partition.py``) and keeps only the blocks of this rank's stages, under
their serial names (``blocks.<i>``), plus the first part on the rank of stage 0 and the
last part on the rank of stage S-1. Weights are drawn by serial name (``tensor/init.py``),
so every stage holds exactly the serial model's weights.

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
from typing import Callable, List, Optional, Tuple

from torch import nn

from ..context import ParallelMode, current_context
from ..tensor.placement import param_placement, set_placement
from .partition import StageSpec, balanced_cut, cut, explicit_cut, rank_stages

# weights(method) -> (first part, block weight or one weight per block, last part)
Weights = Callable[[str], Tuple[float, object, float]]


def pipeline_settings():
    """(P, settings) of the current context: P from the layout, the rest from its config."""
    from .config import PipelineSettings, parse_pipeline
    ctx = current_context()
    size = ctx.layout.pipeline if ctx.layout is not None else 1
    settings = parse_pipeline(ctx.config) if ctx.config else PipelineSettings()
    if settings.size != size:  # a described context without a config: defaults
        settings = PipelineSettings(size=size)
    return size, settings


def my_stages(num_layers: int, weights: Optional[Weights] = None) -> List[StageSpec]:
    """This rank's stages for a model of ``num_layers`` blocks under the current context.

    ``weights(method)`` gives ``(first, block, last)`` weights for the ``parameters`` and
    ``cost`` partitions; an explicit partition (a tuple of blocks per stage) is taken as is
    (a ValueError unless it sums to ``num_layers``)."""
    size, settings = pipeline_settings()
    if isinstance(settings.partition, tuple):  # an explicit cut: blocks per stage
        ranges = explicit_cut(settings.partition, num_layers)
        rank = current_context().axis(ParallelMode.PIPELINE).rank
        return rank_stages(ranges, size, rank)
    if settings.stages == 1:
        return [StageSpec(0, 1, range(num_layers))]
    if num_layers < settings.stages:
        raise ValueError(f'model.layers = {num_layers} is fewer than the pipeline stages '
                         f'(pipeline size {size} x chunks {settings.chunks} = '
                         f'{settings.stages}): every stage needs at least one layer')
    if settings.partition != 'uniform':
        if weights is None:
            raise ValueError(f"partition {settings.partition!r} needs the model's layer weights")
        first, block, last = weights(settings.partition)
        blocks = list(block) if isinstance(block, (list, tuple)) else [block] * num_layers
        agreed = _agreed([first, last] + blocks)
        ranges = balanced_cut(agreed[2:], settings.stages, agreed[0], agreed[1])
    else:
        ranges = cut('uniform', num_layers, settings.stages)
    rank = current_context().axis(ParallelMode.PIPELINE).rank
    return rank_stages(ranges, size, rank)


def _agreed(values: List[float]) -> List[float]:
    """The maximum of every rank's values (measured costs differ from rank to rank; every
    rank must cut the model alike): one MAX all_reduce over GLOBAL when launched."""
    ctx = current_context()
    if ctx.is_described or ctx.axis(ParallelMode.GLOBAL).size == 1:
        return values
    import torch
    import torch.distributed as dist
    from ..communication import collective as C
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
    from ..config import parse_parallel
    layout = parse_parallel({'pipeline': 3}).with_world_size(3)
    with torch.device('cpu'):
        return _time_stages(build, sample(), layout, repeats)


def _time_stages(build, inputs, layout, repeats):
    import statistics
    import time
    import torch
    from ..context import ParallelContext, use_context
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
    """Mixin for models cut into pipeline stages (module doc)."""

    stages: List[StageSpec]

    def plan_stages(self, num_layers: int, weights: Optional[Weights] = None):
        """Decide this rank's stages (``self.stages``); call before building any part."""
        self.stages = my_stages(num_layers, weights)
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
            raise ValueError(f'stage 0 starts from the inputs; got a stage_input')
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


def transformer_weights(hidden: int, mlp_ratio: int, first_params: int, last_params: int,
                        measure: Optional[Callable[[], Tuple[float, float, float]]] = None
                        ) -> Weights:
    """``weights(method)`` for a pre/post-LN transformer: parameter counts of a block
    ((4 + 2r) h^2 + (9 + r) h), the first and last parts; or measured times (``measure``,
    e.g. :func:`measure_part_costs`)."""
    def weights(method: str) -> Tuple[float, float, float]:
        if method == 'parameters':
            block = (4 + 2 * mlp_ratio) * hidden ** 2 + (9 + mlp_ratio) * hidden
            return float(first_params), float(block), float(last_params)
        if measure is None:
            raise ValueError(f"partition {method!r} is not available for this model")
        return measure()
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
        from ..tensor import init_by_name
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
