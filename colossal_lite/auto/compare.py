"""The layer-level plan beside the graph-level plan, priced under one cost model.

``colossal-lite plan --model NAME`` (``commands/plan.py``) prints the layer planner's choice
(``planner.plan``: a layout of data x pipeline x tensor mode x ZeRO, priced by ``cost.py``)
and then :func:`compare_plans`' report:

1. the same model is built serially on the meta device (``job.describe_model`` for a
   one-rank layout), captured with its registered loss on ``[batch, seq]`` token ids (or
   ``[batch, channels, image, image]`` images) and labels (``graph.trace.capture``), and
   searched on the mesh ``data=D x tensor=t`` of the layout it is compared with (axes of
   size 1 dropped; ``graph.api.search`` at ``level``, under the same memory budget);
2. that layout is expressed on the graph where it can be -- data parallelism x 1D
   (Megatron) tensor parallelism, one pass over the batch: every parameter pinned
   (``graph.api.apply_pins``) to the placements the 1D family gives it (read from the
   ``Placement`` of the model built for the layout: ``S<d>`` on the tensor axis where it is
   cut along d, ``R`` elsewhere and on the data axis), every input split along the batch on
   the data axis; the solver then places the activations -- and priced by ``GraphCost``;
3. the winner is the cheaper of the graph plan and the pinned layout, both priced by
   ``GraphCost`` (``auto/graph/cost.py``), never a layer-model number against a GraphCost
   one.

A layout the graph cannot express -- pipeline stages, a 2D / 2.5D / 3D / sequence (ring)
tensor mode, Megatron sequence parallelism, ZeRO or host offload, activation checkpointing
(GraphCost has no recompute) or gradient accumulation over M > 1 micro-batches (the graph is
one pass over the batch) -- is named with the reason, and the fastest feasible layer
candidate that *can* be expressed is compared instead (when there is one), labelled as such.
A model that does not trace, or a budget no graph plan meets, is reported, not raised.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn

from ..config import ParallelLayout
from ..context import ParallelMode
from ..job import describe_model
from .cluster import ClusterProfile
from .cost import Candidate, Estimate
from .graph.api import NoPlanFits, apply_pins, search as graph_search
from .graph.plan import Plan as GraphPlan
from .graph.space import Space
from .graph.trace import GraphBreakError, capture
from .model_spec import ModelShape, model_shape, resolve_model_name
from .offload import is_offloaded
from .planner import Plan, plan
from .search import job_spec

GiB = 2 ** 30
PREFIX = 'model.'      # the captured wrapper's attribute: graph names are 'model.<fqn>'
LAYER_MODEL = 'layer cost model, auto/cost.py'
GRAPH_MODEL = 'GraphCost, auto/graph/cost.py'
TENSOR_MODES = {
    '2d': '2D tensor parallelism (SUMMA on a q x q grid)',
    '2.5d': '2.5D tensor parallelism (SUMMA over depth-stacked grids)',
    '3d': '3D tensor parallelism (cube matmuls)',
    'sequence': 'sequence (ring attention) parallelism',
    'ulysses': 'Ulysses sequence parallelism (all_to_all around attention)',
}


def ms(seconds: float) -> str:
    """A step time as the report writes it: milliseconds, 4 significant digits."""
    return f'{seconds * 1e3:.4g} ms'


def _size(nbytes: float) -> str:
    return f'{nbytes / GiB:.2f} GiB' if nbytes >= 0.1 * GiB else f'{nbytes / 2 ** 20:.1f} MiB'


def unexpressible(cand: Candidate) -> Optional[str]:
    """Why ``cand`` has no equivalent graph plan (see the module doc); None when it has one
    (data parallel x 1D or no tensor mode, no ZeRO, no checkpointing, M = 1)."""
    l = cand.layout
    why = []
    if l.pipeline > 1:
        why.append(f'pipeline of {l.pipeline} stages (graph plans have no pipeline yet)')
    if l.mode not in (None, '1d'):
        why.append(TENSOR_MODES.get(l.mode, f'tensor mode {l.mode!r}'))
    if getattr(l, 'sequence_parallel', False):
        why.append('Megatron sequence parallelism')
    if cand.zero:
        why.append(f'ZeRO-{cand.zero} (sharded optimizer states are not graph placements)')
    if is_offloaded(cand):
        why.append('host offload')
    if cand.checkpoint:
        why.append('activation checkpointing (GraphCost has no recompute)')
    if cand.microbatches > 1 and l.pipeline == 1:
        why.append(f'gradient accumulation over M={cand.microbatches} micro-batches (a graph '
                   f'plan is one pass over the batch)')
    return '; '.join(why) or None


def graph_mesh(layout: ParallelLayout) -> Dict[str, int]:
    """The mesh a layout's devices form for the graph planner: ``data`` (the pipeline folded
    into it) x ``tensor``, axes of one device dropped (at least one axis kept)."""
    mesh = {'data': layout.data * layout.pipeline, 'tensor': layout.tensor}
    return {k: v for k, v in mesh.items() if v > 1} or {'data': 1}


def _example_inputs(shape: ModelShape, batch: int):
    """The full inputs and labels a step of the planner's job feeds (meta tensors)."""
    with torch.device('meta'):
        if shape.traits.inputs == 'images':
            names = shape.names
            image, chans = shape.option(names.image), shape.option(names.channels)
            return (torch.zeros(batch, chans, image, image),
                    torch.zeros(batch, dtype=torch.long))
        return (torch.zeros(batch, shape.seq, dtype=torch.long),
                torch.zeros(batch, shape.seq, dtype=torch.long))


class _Supervised(nn.Module):
    """``loss(model(inputs), labels)``: the training step's forward as one module."""

    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, inputs, labels):
        return self.loss(self.model(inputs), labels)


def capture_model(shape: ModelShape, batch: int):
    """The registered model built serially on meta and captured with its loss:
    ``graph.trace.Captured`` (parameters named ``model.<fqn>``)."""
    spec = job_spec(shape, batch)
    model = describe_model(spec, ParallelLayout(1, 1, None, 1, 1), 0)
    loss = spec.entry.loss() if spec.entry.loss is not None else nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # ops with no rule are listed in plan.explain()
        return capture(_Supervised(model, loss), _example_inputs(shape, batch))


def layout_pins(shape: ModelShape, cand: Candidate, batch: int, space: Space,
                mesh: Dict[str, int]) -> Dict[str, List[str]]:
    """Graph pins expressing ``cand`` (data x 1D, see the module doc): each parameter's
    placements per mesh axis from the ``Placement`` of the model built for the layout, each
    graph input split along its batch dim on ``data``."""
    model = describe_model(job_spec(shape, batch), cand.layout, 0)
    in_graph = {d.source for d in space.decisions if d.kind == 'param'}
    pins: Dict[str, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # tied: every name
        key = PREFIX + name
        if key not in in_graph:
            continue
        cuts = getattr(getattr(param, 'placement', None), 'cuts', ())
        other = [mode for _, mode in cuts if mode is not ParallelMode.PARALLEL_1D]
        if other:
            raise ValueError(f'{name} is cut over {other}: not a data x 1D placement')
        split = [dim for dim, _ in cuts]
        pins[key] = ['R' if axis == 'data' or not split else f'S{split[0]}' for axis in mesh]
    for d in space.decisions:
        if d.kind == 'input':
            pins[d.name] = ['S0' if axis == 'data' else 'R' for axis in mesh]
    return pins


def pinned_copy(space: Space, pins: Dict[str, List[str]]) -> Space:
    """A copy of ``space`` whose decisions keep only the strategies ``pins`` allow (the
    original is untouched: one capture serves both searches)."""
    pinned = copy.copy(space)
    pinned.decisions = [dataclasses.replace(d, strategies=list(d.strategies))
                        for d in space.decisions]
    apply_pins(pinned, pins)
    return pinned


@dataclass
class GraphComparison:
    """:func:`compare_plans`' result. ``layer``: the layer planner's best (its numbers from
    the layer cost model); ``unexpressible``: why it has no graph equivalent (None: it has);
    ``compared``: the layer candidate expressed on the graph (``layer`` itself, or the
    fastest expressible feasible candidate, or None); ``graph``: the graph search's plan on
    ``mesh``, solved on ``space``; ``pinned``: ``compared`` on the graph (its ``pins``), solved on
    ``pinned_space`` -- both priced by GraphCost; ``pinned_fits``: whether the pinned plan
    met the budget under GraphCost's memory model (else it was priced without the budget);
    ``note``: why the graph side is missing (no trace, no plan fits); ``seconds``: capture,
    space and search times."""

    layer: Estimate
    level: str
    mesh: Dict[str, int]
    budget: float
    cluster: ClusterProfile
    unexpressible: Optional[str] = None
    compared: Optional[Estimate] = None
    graph: Optional[GraphPlan] = None
    space: Optional[Space] = None
    pinned: Optional[GraphPlan] = None
    pins: Dict[str, List[str]] = field(default_factory=dict)
    pinned_space: Optional[Space] = None
    pinned_fits: bool = True
    note: Optional[str] = None
    seconds: Dict[str, float] = field(default_factory=dict)

    @property
    def graph_step(self) -> Optional[float]:
        return None if self.graph is None else float(self.graph.predicted['step_s'])

    @property
    def pinned_step(self) -> Optional[float]:
        return None if self.pinned is None else float(self.pinned.predicted['step_s'])

    @property
    def winner(self) -> Optional[str]:
        """'graph', 'layer' or 'tie': the argmin of the two GraphCost step times (the graph
        plan's and the pinned layout's); None when either is missing."""
        g, p = self.graph_step, self.pinned_step
        if g is None or p is None:
            return None
        if abs(g - p) <= 1e-9 * max(g, p):
            return 'tie'
        return 'graph' if g < p else 'layer'

    def report(self) -> str:
        took = ', '.join(f'{k} {v:.1f} s' for k, v in self.seconds.items())
        mesh = ' x '.join(f'{k}={v}' for k, v in self.mesh.items())
        lines = [f'graph-level comparison (level {self.level}{"; " + took if took else ""}):']
        lay = self.layer
        lines.append(f'  layer planner:  {lay.candidate.describe()}: '
                     f'{ms(lay.step_time)}, {_size(lay.peak_memory)} per device '
                     f'({LAYER_MODEL})')
        if self.graph is not None:
            pred = self.graph.predicted
            params = [e['out'][0] for e in self.graph.nodes.values() if e['op'] == 'param']
            split = sum(any(p != 'R' for p in out) for out in params)
            lines.append(f'  graph plan:     mesh {mesh}: {ms(pred["step_s"])}, '
                         f'{_size(pred["memory_bytes"])} per rank ({GRAPH_MODEL}); '
                         f'{split} of {len(params)} parameters split')
        else:
            lines.append(f'  graph plan:     none on mesh {mesh}: {self.note}')
        if self.unexpressible:
            theirs = ('has no GraphCost counterpart' if self.graph is None else
                      f'is not compared with the graph plan\'s {ms(self.graph_step)} '
                      f'(GraphCost): they come from different cost models')
            lines.append(f'  not comparable: the layer planner\'s layout cannot be expressed on '
                         f'the graph ({self.unexpressible}), so its {ms(lay.step_time)} '
                         f'(layer cost model) {theirs}')
            if self.compared is None:
                lines.append('  no feasible layer candidate is expressible on the graph '
                             '(data x 1D, no ZeRO, no checkpointing, M=1): nothing to compare')
                return '\n'.join(lines)
            c = self.compared
            lines.append(f'  compared instead: the fastest layer candidate the graph expresses, '
                         f'{c.candidate.describe()}: {ms(c.step_time)}, '
                         f'{_size(c.peak_memory)} per device ({LAYER_MODEL})')
        if self.pinned is None:
            return '\n'.join(lines)
        what = 'data parallel' + (' x 1D Megatron' if self.compared.candidate.layout.mode
                                  else '')
        pred = self.pinned.predicted
        fits = '' if self.pinned_fits else \
            f'; over the {_size(self.budget)} budget under GraphCost\'s memory model'
        lines.append(f'  {"layer layout" if self.compared is self.layer else "that candidate"}'
                     f' on the graph ({what}, parameters pinned): '
                     f'{ms(pred["step_s"])}, {_size(pred["memory_bytes"])} per rank '
                     f'({GRAPH_MODEL}{fits})')
        g, p = self.graph_step, self.pinned_step
        winner = self.winner
        layer_name = 'the layer planner\'s layout' if self.compared is self.layer else \
            'the layer candidate compared'
        if winner is None:
            lines.append(f'  no winner: no graph plan to compare with ({self.note})')
        elif winner == 'tie':
            lines.append(f'  under GraphCost the two tie at {ms(g)}')
        elif winner == 'graph':
            lines.append(f'  under GraphCost the graph plan wins: {ms(g)} vs '
                         f'{ms(p)} for {layer_name}, {p / g:.2f}x faster '
                         f'({(1 - g / p) * 100:.1f}% less step time)')
        else:
            why = (f'; the pinned choices are among the graph search\'s, so the {self.level} '
                   f'search missed them' + (' (try --level optimal)' if self.level == 'fast'
                                            else '')
                   if self.pinned_fits else ', but it is over the memory budget under '
                                            'GraphCost, which the graph plan must meet')
            lines.append(f'  under GraphCost {layer_name} wins: {ms(p)} vs '
                         f'{ms(g)} for the graph plan, {g / p:.2f}x faster{why}')
        return '\n'.join(lines)


def _compared(layer_plan: Plan) -> Optional[Estimate]:
    """The layer candidate expressed on the graph: the plan's own when it can be, else the
    fastest feasible one that can."""
    if unexpressible(layer_plan.estimate.candidate) is None:
        return layer_plan.estimate
    return next((e for e in layer_plan.search.feasible
                 if unexpressible(e.candidate) is None), None)


def compare_plans(layer_plan: Plan, shape: ModelShape, batch: int,
                  level: str = 'fast') -> GraphComparison:
    """See the module doc. ``layer_plan``: ``planner.plan``'s result for ``shape`` and
    ``batch``; ``level``: the graph search's ('fast' or 'optimal')."""
    best = layer_plan.estimate
    cluster, budget = layer_plan.cluster, layer_plan.search.budget
    compared = _compared(layer_plan)
    layout = (compared or best).candidate.layout
    mesh = graph_mesh(layout)
    result = GraphComparison(best, level, mesh, budget, cluster,
                             unexpressible=unexpressible(best.candidate), compared=compared)
    memory_gb = budget / GiB
    start = time.perf_counter()
    try:
        captured = capture_model(shape, batch)
    except GraphBreakError as exc:
        result.note = f'the model does not trace: {exc}'
        return result
    result.seconds['capture'] = time.perf_counter() - start
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        space = result.space = Space(captured, tuple(mesh.values()))
    result.seconds['space'] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        result.graph = graph_search(space, cluster, memory_gb, level, mesh)
    except NoPlanFits as exc:
        result.note = str(exc)
    if compared is not None:
        result.pins = layout_pins(shape, compared.candidate, batch, space, mesh)
        result.pinned_space = pinned_copy(space, result.pins)
        try:
            result.pinned = graph_search(result.pinned_space, cluster, memory_gb, level, mesh)
        except NoPlanFits:
            result.pinned_fits = False
            result.pinned = graph_search(result.pinned_space, cluster, None, level, mesh)
    result.seconds['search'] = time.perf_counter() - start
    return result


def compare(model: str, devices: int = 8, memory_gb: Optional[float] = None, cluster=None,
            batch: int = 8, seq: Optional[int] = None, level: str = 'fast',
            **model_overrides) -> GraphComparison:
    """``planner.plan(model, ...)`` and :func:`compare_plans` of its result."""
    layer_plan = plan(model, devices=devices, memory_gb=memory_gb, cluster=cluster,
                      batch=batch, seq=seq, **model_overrides)
    kind, preset = resolve_model_name(model)
    return compare_plans(layer_plan, model_shape(kind, preset, seq, **model_overrides), batch,
                         level)
