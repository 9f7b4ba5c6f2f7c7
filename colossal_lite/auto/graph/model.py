"""The models ``parallelize`` returns: :class:`AutoParallelModel` runs the whole captured graph;
:class:`PipelinedAutoModel` runs this rank's pipeline stages of it (``pipeline.py``).

Both adopt the serial model's children, parameters and buffers under their own names (so
``state_dict()`` and ``named_parameters()`` carry the serial keys), hold the parameters as
DTensors with the plan's placements, and reduce their own gradients (DTensor), so
``initialize()`` adds no data-parallel handler.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...communication import collective as C
from ...config.modes import ParallelMode
from ...engine.clip import PIPELINE_HOLDERS
from .execute import CollectiveCounter, GraphRunner, local_shape
from .lower import LoweredStep, has_random_ops
from .pipeline import Boundary, StageGraph, StageRunner, stage_specs_of
from .plan import Plan
from .trace import Captured

_PLACEHOLDER_KINDS = ('param', 'buffer', 'constant', 'input')


def input_values(captured: Captured, module: nn.Module, inputs: Sequence,
                 boundary: Sequence = ()) -> List:
    """The values of ``captured``'s placeholders, in order: the module's parameters and
    buffers by fqn, constants, the user's inputs and the values received from the previous
    pipeline stage."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    values = []
    for kind, source in captured.inputs:
        if kind == 'param':
            values.append(params[source])
        elif kind == 'buffer':
            values.append(buffers[source])
        elif kind == 'constant':
            values.append(captured.constants[source])
        elif kind == 'boundary':
            values.append(boundary[source])
        else:
            values.append(inputs[source])
    return values


class AutoParallelModel(nn.Module):
    """The parallel model: ``forward(*inputs)`` returns the (replicated) loss; parameters are
    DTensors with the plan's placements under their serial names."""

    def __init__(self, model: nn.Module, captured: Captured, mesh, plan: Plan,
                 autocast: Optional[torch.dtype] = None):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in model.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        object.__setattr__(self, 'module', model)
        self.plan = plan
        self.autocast = autocast      # the autocast dtype the graph was captured under
        self._captured = captured
        self._mesh = mesh
        space_names = {n.name for n in captured.graph.nodes}
        self._choice = {name: plan.strategy(name) for name, e in plan.nodes.items()
                        if name in space_names and e['op'] not in _PLACEHOLDER_KINDS}
        self._placeholders = {name: plan.strategy(name).outputs[0]
                              for name, e in plan.nodes.items() if e['op'] in _PLACEHOLDER_KINDS}
        self._counter = CollectiveCounter(mesh)
        self._build_runners()

    def _build_runners(self):
        self._runner = GraphRunner(self._captured, self._mesh, self._choice, self._placeholders)
        # graphs with random ops run through the interpreter (see lower.py)
        self.lowered = None if has_random_ops(self._captured.graph) else LoweredStep(
            self._runner.run, [kind == 'param' for kind, _ in self._captured.inputs],
            self._counter.entry)

    @property
    def last_deviations(self) -> Dict[str, int]:
        """Nodes whose output came back elsewhere than planned in the last forward."""
        return self._runner.deviations

    @property
    def device_mesh(self):
        return self._mesh

    def forward(self, *inputs):
        self._check_autocast()
        with torch.autocast(self._mesh.device_type, enabled=False):  # the graph holds its casts
            return self._forward(*inputs)

    def _check_autocast(self):
        """The graph holds the casts of the autocast it was captured under (none without):
        running it under another would silently change its numbers, so that is an error."""
        device = self._mesh.device_type
        active = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        if active != self.autocast:
            def say(dtype):
                return 'no autocast' if dtype is None else f'autocast {dtype}'
            raise RuntimeError(
                f'this model was planned under {say(self.autocast)} and now runs under '
                f'{say(active)}: the captured graph holds the casts of the first; plan it with '
                f'parallelize(..., autocast={active}) (fp16=dict(mode="torch") autocasts '
                f'to {torch.bfloat16 if device == "cpu" else "fp16.dtype"} on {device})')

    def _forward(self, *inputs):
        values = input_values(self._captured, self.module, inputs)
        if self.lowered is not None and torch.is_grad_enabled():
            program = self.lowered.program(values)     # traced (uncounted) on first use
            if program is not None:
                return self.lowered.run(program, values)
        with self._counter:
            return self._runner.run(*values)

    def backward_context(self):
        """Enter around ``loss.backward()`` to count the backward's collectives too (the
        Engine does; autograd runs backward with the modes active when it was called)."""
        return self._counter

    # the model synchronizes its own gradients (DTensor): initialize() adds no handler
    synchronizes_gradients = True


class PipelinedAutoModel(AutoParallelModel):
    """This pipeline rank's stages of a graph plan (``pipeline.py``), for the pipeline runtime:
    ``forward(*inputs, stage_input=None, stage=None)`` runs stage ``stage`` of one
    micro-batch; stage 0 starts from the inputs, a later one from ``stage_input`` (the flat
    tensor the previous stage sent; the inputs are still passed: free ops read them). The last
    stage returns the loss (``returns_loss``), the others the flat tensor they send.
    ``stages``: this rank's :class:`~colossal_lite.pipeline.partition.StageSpec` list.

    ``stage_graphs``: every stage's graph (the same on every rank); ``pipe_rank`` /
    ``pipe_size``: this rank's pipeline coordinate and the pipeline size."""

    returns_loss = True

    def __init__(self, model: nn.Module, captured: Captured, mesh, plan: Plan,
                 stage_graphs: Sequence[StageGraph], pipe_rank: int, pipe_size: int,
                 autocast: Optional[torch.dtype] = None):
        self._stage_graphs = list(stage_graphs)
        self._pipe_size = pipe_size
        self.stages = stage_specs_of(len(stage_graphs), pipe_size, pipe_rank)
        super().__init__(model, captured, mesh, plan, autocast)

    def _build_runners(self):
        count = len(self._stage_graphs)
        ranks = {}      # fqn -> the pipeline ranks whose stages read it
        for graph in self._stage_graphs:
            for fqn in graph.params:
                ranks.setdefault(fqn, set()).add(graph.index % self._pipe_size)
        held = dict(self.module.named_parameters(remove_duplicate=False))
        for fqn in self.shared_parameters():
            if fqn in held and len(ranks[fqn]) > 1:
                setattr(held[fqn], PIPELINE_HOLDERS, len(ranks[fqn]))
        self._runners, self._receive, self._send = {}, {}, {}
        for spec in self.stages:
            graph = self._stage_graphs[spec.index]
            self._runners[spec.index] = StageRunner(graph, self._mesh, self._choice,
                                                    self._placeholders, spec.last)
            nodes = {n.name: n for n in self._captured.graph.nodes}
            self._receive[spec.index] = Boundary([nodes[n] for n in graph.receives],
                                                 self._choice, self._mesh)
            if spec.index < count - 1:
                self._send[spec.index] = Boundary([nodes[n] for n in graph.sends],
                                                  self._choice, self._mesh)
        self.lowered = None
        self._runner = self._runners[self.stages[0].index]

    def forward(self, *inputs, stage_input: Optional[torch.Tensor] = None,
                stage: Optional[int] = None):
        stage = self.stages[0].index if stage is None else stage
        if stage not in self._runners:
            raise ValueError(f'stage {stage} does not run on this rank (it holds stages '
                             f'{[s.index for s in self.stages]})')
        if stage > 0 and stage_input is None:
            raise ValueError(f'stage {stage} needs stage_input, the previous stage\'s output')
        self._check_autocast()
        boundary = self._receive[stage].unpack(stage_input) if stage > 0 else ()
        values = input_values(self._stage_graphs[stage].captured, self.module, inputs, boundary)
        self._runner = self._runners[stage]
        with torch.autocast(self._mesh.device_type, enabled=False), self._counter:
            out = self._runner.run(*values)
        return out if stage == len(self._stage_graphs) - 1 else self._send[stage].pack(out)

    def shared_parameters(self) -> List[str]:
        """Parameters read by more than one stage (a tied embedding and LM head)."""
        count: Dict[str, int] = {}
        for graph in self._stage_graphs:
            for fqn in graph.params:
                count[fqn] = count.get(fqn, 0) + 1
        return sorted(f for f, n in count.items() if n > 1)

    def synchronize_stage_gradients(self):
        """Sum, over PIPELINE, the gradients of parameters held by several stages; a rank
        whose stages do not read one adds zeros of its local shard's shape."""
        held = dict(self.module.named_parameters(remove_duplicate=False))
        metas = {}
        for graph in self._stage_graphs:
            phs = [n for n in graph.captured.graph.nodes if n.op == 'placeholder']
            for node, (kind, source) in zip(phs, graph.captured.inputs):
                if kind == 'param':
                    metas[source] = node.meta['val']
        for fqn in self.shared_parameters():
            param = held.get(fqn)
            if param is not None:
                grad = param.grad
                local = (grad.to_local() if grad is not None
                         else torch.zeros_like(param.to_local()))
            else:
                placements = self.plan.strategy(self._placeholder_node(fqn)).outputs[0]
                local = torch.zeros(local_shape(metas[fqn].shape, self._mesh, placements),
                                    dtype=metas[fqn].dtype, device=self._mesh.device_type)
            summed = C.all_reduce(local.contiguous(), ParallelMode.PIPELINE)
            if param is not None:
                param.grad = DTensor.from_local(summed, self._mesh, param.placements,
                                                run_check=False, shape=param.shape,
                                                stride=param.stride())

    def _placeholder_node(self, fqn: str) -> str:
        return next(name for name, e in self.plan.nodes.items()
                    if e['op'] == 'param' and e.get('source') == fqn)
