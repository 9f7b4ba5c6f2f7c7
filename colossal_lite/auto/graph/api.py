"""``parallelize(model, example_inputs, ...)``: plan any single-device model and run it
in parallel (docs/auto_graph.md).

capture (``trace.py``) -> strategies per node (``space.py`` over ``strategies.py``) -> prices
(``cost.py``) -> solve (``solver.py``: ``fast`` greedy + ICM, ``optimal`` ILP) -> the
:class:`Plan` -> :class:`AutoParallelModel`, which holds the model's parameters as DTensors
with the plan's placements and runs the captured graph with ``execute.GraphRunner``.
"""
from __future__ import annotations

import math
import re
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from ...config.checks import ConfigError
from ...config.modes import ParallelMode
from ...context.parallel_context import current_context
from ..cluster import ClusterProfile, load_profile
from .cost import GraphCost
from .execute import CollectiveCounter, GraphRunner, distribute_parameters
from .lower import LoweredStep, has_random_ops
from .plan import Plan, fingerprint, names
from .solver import InfeasibleBudget, Solution, solve
from .space import Space
from .strategies import placement_from_name
from .trace import Captured, capture

LEVELS = ('fast', 'optimal')
AXIS_NAMES = {1: ('tensor',), 2: ('data', 'tensor'), 3: ('data', 'tensor', 'tensor2')}
MeshSpec = Union[None, Dict[str, int], Sequence[int]]


class NoPlanFits(ValueError):
    """No strategy choice meets the memory budget; the message gives the smallest peak."""


def resolve_mesh(mesh: MeshSpec, world_size: int) -> Dict[str, int]:
    """Mesh axes as ``{name: size}``: a dict as given; a tuple of 1-3 sizes named
    ``tensor`` / ``data, tensor`` / ``data, tensor, tensor2``; None: the launched context's data x tensor axes."""
    if mesh is None:
        ctx = current_context()
        mesh = {'data': ctx.get_world_size(ParallelMode.DATA),
                'tensor': ctx.get_world_size(ParallelMode.TENSOR)}
    elif not isinstance(mesh, dict):
        sizes = tuple(mesh)
        if not 1 <= len(sizes) <= 3:
            raise ConfigError(f'auto mesh must have 1 to 3 axes, got {sizes!r}')
        mesh = dict(zip(AXIS_NAMES[len(sizes)], sizes))
    for name, size in mesh.items():
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f'auto mesh axis {name!r} must be a positive integer, got {size!r}')
    if math.prod(mesh.values()) != world_size:
        raise ConfigError(f'auto mesh {mesh} has {math.prod(mesh.values())} devices but the '
                          f'world has {world_size}; the product of the axes must equal it')
    return dict(mesh)


def repeated_groups(space: Space) -> List[List[int]]:
    """Decisions of identical repeated blocks (same module path up to the layer index, same
    op, same occurrence in the block, same candidate strategies): one shared choice each."""
    buckets: Dict[tuple, List[int]] = {}
    seen: Dict[tuple, int] = {}
    for i, d in enumerate(space.decisions):
        if d.kind in ('param', 'buffer'):
            path = str(d.source)
        else:
            stack = d.node.meta.get('nn_module_stack') or {}
            path = list(stack.values())[-1][0] if stack else ''
        if not re.search(r'\.\d+(\.|$)', path):
            continue
        generic = re.sub(r'\.\d+(?=\.|$)', '.#', path)
        block = re.findall(r'\.\d+(?=\.|$)', path)[0]
        op = str(d.node.target) if d.kind == 'op' else ''
        base = (generic, op, d.kind)
        seen_key = base + (block,)
        occurrence = seen.get(seen_key, 0)
        seen[seen_key] = occurrence + 1
        buckets.setdefault(base + (occurrence, tuple(d.strategies)), []).append(i)
    return [ids for ids in buckets.values() if len(ids) > 1]


def search(space: Space, cluster: ClusterProfile, memory_gb: Optional[float], level: str,
           mesh: Dict[str, int], time_limit: float = 60.0, device: str = 'cuda') -> Plan:
    """Solve the space into a :class:`Plan` (see the module doc)."""
    if level not in LEVELS:
        raise ValueError(f'level must be one of {LEVELS}, got {level!r}')
    start = time.perf_counter()
    cost = GraphCost(space, cluster, all_to_all=device != 'cpu')
    budget = None if memory_gb is None else memory_gb * 2 ** 30
    problem = cost.problem(budget, repeated_groups(space))
    solution, peak = _solve_within(cost, problem, budget, level, time_limit,
                                   f'memory_gb={memory_gb} per rank on mesh {mesh}')
    if not math.isfinite(solution.objective):
        raise RuntimeError(f'the {level} solver returned a plan that asks for a Partial no '
                           f'producer gives (objective {solution.objective}); try the other level')
    choice = solution.choice
    compute = sum(float(cost._node_cost(i)[c]) for i, c in enumerate(choice))
    plan = plan_from_choice(space, choice, mesh, level, time.perf_counter() - start, {
        'step_s': solution.objective, 'compute_s': compute,
        'comm_s': solution.objective - compute, 'memory_bytes': peak['peak'],
        'memory_phase': peak['phase'], 'memory_linear_bytes': solution.memory,
        'comm_bytes': cost.comm_bytes(choice)})
    for name, moves in cost.moves(choice, list(mesh)).items():
        plan.nodes[name]['moves'] = moves
    return plan


RESOLVES = 5     # solves per search: the linear budget moves by the peak's miss each time


def _solve_within(cost: GraphCost, problem, budget: Optional[float], level: str,
                  time_limit: float, what: str):
    """(solution, its peak). The solver budgets the linear part of the memory
    (``GraphCost.memory``); the solution's peak (``GraphCost.peak_memory``) is the prediction
    and must fit ``budget``. A pass moves the linear budget by the peak's miss: while the
    peak is over, the next linear budget is the solution's linear memory less the excess (and
    1% of the budget), never below the least linear memory (halfway there instead); while it
    fits with room to spare and the linear budget bound the solution, its linear memory plus
    the room; at most ``RESOLVES`` solves. When the first pass (inputs saved unmoved shared
    with their producer) finds nothing that fits, a second one budgets the conservative sum
    (every saved input counted, as if moved). The fastest fitting solution wins; with none,
    each node's least-memory strategy is taken if it is a plan and its peak fits, else
    :class:`NoPlanFits` names the smallest peak seen."""
    if budget is None:
        solution = solve(problem, level=level, time_limit=time_limit)
        return solution, cost.peak_memory(solution.choice)
    tol = 1e-9 * max(1.0, budget)
    smallest = math.inf
    for shared in (True, False):
        if not shared:
            problem.memory = [cost.memory(i, shared=False) for i in range(len(problem.memory))]
        problem.budget = budget
        least = _least_memory_choice(problem)
        floor = problem.memory_of(least)          # no linear budget below this has a solution
        best = None
        for _ in range(RESOLVES):
            try:
                solution = solve(problem, level=level, time_limit=time_limit)
            except InfeasibleBudget:
                break
            peak = cost.peak_memory(solution.choice)
            smallest = min(smallest, peak['peak'])
            if peak['peak'] <= budget + tol and math.isfinite(solution.objective):
                if best is None or solution.objective < best[0].objective:
                    best = (solution, peak)
                bound = solution.memory >= problem.budget * (1 - 1e-3)
                if not bound or peak['peak'] >= 0.99 * budget:
                    break
                problem.budget = solution.memory + budget - peak['peak']
            else:
                lower = solution.memory - (peak['peak'] - budget) - 0.01 * budget
                problem.budget = lower if lower >= floor else (floor + solution.memory) / 2
        if best is not None:
            return best
    peak = cost.peak_memory(least)
    objective = problem.objective(least)
    if peak['peak'] <= budget + tol and math.isfinite(objective):
        return Solution(least, objective, floor, level, 0.0), peak
    raise NoPlanFits(f'no plan fits {what}: the smallest predicted peak is '
                     f'{min(smallest, peak["peak"]) / 2 ** 30:.6f} GiB')


def _least_memory_choice(problem) -> List[int]:
    """Each node's least-memory strategy (a group's least summed memory)."""
    choice = [int(np.argmin(m)) for m in problem.memory]
    for members in problem.groups:
        k = int(np.argmin(sum(problem.memory[i] for i in members)))
        for i in members:
            choice[i] = k
    return choice


def plan_from_choice(space: Space, choice: Sequence[int], mesh: Dict[str, int], level: str,
                      seconds: float, predicted: dict) -> Plan:
    nodes, params = {}, {}
    for d, c in zip(space.decisions, choice):
        st = d.strategies[c]
        nodes[d.name] = Plan.entry(str(d.node.target) if d.kind == 'op' else d.kind, st)
        if d.kind != 'op':
            nodes[d.name]['source'] = d.source
        if d.kind in ('param', 'buffer'):
            params[d.source] = names(st.outputs[0])
    return Plan(mesh=mesh, nodes=nodes, params=params, predicted=predicted,
                unruled=list(space.unruled), level=level, search_seconds=seconds,
                graph=fingerprint(space.captured.graph))


def apply_pins(space: Space, pins: Optional[Dict[str, Sequence[str]]]) -> None:
    """Keep only the strategies whose output matches a pin (by parameter fqn or node name)."""
    for key, want in (pins or {}).items():
        want = tuple(placement_from_name(p) for p in want)
        hits = [d for d in space.decisions if d.source == key or d.name == key]
        if not hits:
            raise ValueError(f'pin {key!r} names no parameter or graph node')
        for d in hits:
            kept = [s for s in d.strategies if s.outputs and s.outputs[0] == want]
            if not kept:
                raise ValueError(f'pin {key!r}: placements {list(names(want))} are not among '
                                 f'its strategies on this mesh')
            d.strategies = kept


def _search_on_rank0(captured: Captured, axes: Dict[str, int], pins, cluster, memory_gb,
                     level: str, device: str) -> Plan:
    """Rank 0 searches; every rank gets its plan (or its error) by one broadcast, so all
    ranks run the same plan and fail together."""
    import torch.distributed as dist
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    result = [None]
    if not distributed or dist.get_rank() == 0:
        try:
            space = Space(captured, tuple(axes.values()))
            apply_pins(space, pins)
            result[0] = search(space, load_profile(cluster), memory_gb, level, axes,
                               device=device).to_json()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            if not distributed:
                raise
            result[0] = exc
    if distributed:
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], Exception):
        raise result[0]
    return Plan.from_json(result[0])


class AutoParallelModel(nn.Module):
    """The parallel model: ``forward(*inputs)`` returns the (replicated) loss; parameters are
    DTensors with the plan's placements under their serial names."""

    def __init__(self, model: nn.Module, captured: Captured, mesh, plan: Plan,
                 autocast: Optional[torch.dtype] = None):
        super().__init__()
        # the model's children, parameters and buffers are adopted under their own names,
        # so state_dict() and named_parameters() carry the serial keys
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
                        if name in space_names and e['op'] not in
                        ('param', 'buffer', 'constant', 'input')}
        self._placeholders = {name: plan.strategy(name).outputs[0]
                              for name, e in plan.nodes.items()
                              if e['op'] in ('param', 'buffer', 'constant', 'input')}
        self._runner = GraphRunner(captured, mesh, self._choice, self._placeholders)
        self._counter = CollectiveCounter(mesh)
        # graphs with random ops run through the interpreter (see lower.py)
        self.lowered = None if has_random_ops(captured.graph) else LoweredStep(
            self._runner.run, [kind == 'param' for kind, _ in captured.inputs],
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
        params = dict(self.module.named_parameters(remove_duplicate=False))
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        values = []
        for kind, source in self._captured.inputs:
            if kind == 'param':
                values.append(params[source])
            elif kind == 'buffer':
                values.append(buffers[source])
            elif kind == 'constant':
                values.append(self._captured.constants[source])
            else:
                values.append(inputs[source])
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


def parallelize(model: nn.Module, example_inputs: Sequence[torch.Tensor], *,
                loss_fn: Optional[Callable] = None, mesh: MeshSpec = None,
                memory_gb: Optional[float] = None, level: str = 'fast',
                pins: Optional[Dict[str, Sequence[str]]] = None, plan: Optional[Plan] = None,
                cluster=None, pipeline=None,
                autocast: Optional[torch.dtype] = None) -> Tuple[AutoParallelModel, Plan]:
    """Plan ``model`` for the launched ranks and return ``(parallel_model, plan)``.

    Every rank passes the same model (same weights) and the same full ``example_inputs``;
    ``loss_fn(output, *inputs)`` turns the output into the scalar loss (None: the model's
    output, or its ``.loss``, is the loss). ``autocast`` (torch.bfloat16 / torch.float16):
    capture under ``torch.autocast`` of that dtype, so the graph holds autocast's casts and
    the model's own (e.g. a loss upcast to fp32, a no-op in an fp32 capture) and is planned
    with its real dtypes; the model must then run under that autocast
    (``fp16=dict(mode='torch')``), and without it only without. See the module doc."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if pipeline not in (None, 1):
        raise NotImplementedError('pipeline stages for graph-level plans are not built yet; '
                                  'use the pipeline runtime with a hand layout')
    world = dist.get_world_size() if dist.is_initialized() else 1
    axes = resolve_mesh(plan.mesh if plan is not None and mesh is None else mesh, world)
    if level not in LEVELS:
        raise ValueError(f'level must be one of {LEVELS}, got {level!r}')
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise ConfigError(f'autocast must be None, torch.bfloat16 or torch.float16, '
                          f'got {autocast!r}')
    device = 'cuda' if next(model.parameters()).is_cuda else 'cpu'
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        captured = capture(model, example_inputs, loss_fn)
    if plan is None:
        plan = _search_on_rank0(captured, axes, pins, cluster, memory_gb, level, device)
    elif plan.graph and plan.graph != fingerprint(captured.graph):
        raise ValueError(
            f'this plan was made for another graph (fingerprint {plan.graph}, this model\'s '
            f'capture {fingerprint(captured.graph)}, stamped repeated blocks: '
            f'{captured.stamped or "none"}): a plan applies to the model, input shapes and '
            f'capture it was made for (docs/auto_graph.md); plan the model again')
    device_mesh = init_device_mesh(device, tuple(axes.values()), mesh_dim_names=tuple(axes))
    distribute_parameters(model, device_mesh, {k: tuple(placement_from_name(p) for p in v)
                                               for k, v in plan.params.items()})
    return AutoParallelModel(model, captured, device_mesh, plan, autocast), plan
