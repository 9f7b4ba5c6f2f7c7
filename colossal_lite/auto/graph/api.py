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
from .execute import _owner, distribute_parameters
from .model import AutoParallelModel, PipelinedAutoModel
from .pipeline import plan_cut, split
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
           mesh: Dict[str, int], time_limit: float = 60.0, device: str = 'cuda',
           stages: int = 1) -> Plan:
    """Solve the space into a :class:`Plan` (see the module doc); with ``stages`` > 1 the
    plan also holds the pipeline cut of the solved graph (``pipeline.plan_cut``)."""
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
    step = solution.objective - cost.shared_overcharge(choice)
    plan = plan_from_choice(space, choice, mesh, level, time.perf_counter() - start, {
        'step_s': step, 'compute_s': compute, 'comm_s': step - compute, 'memory_bytes': peak['peak'],
        'memory_phase': peak['phase'], 'memory_linear_bytes': solution.memory,
        'comm_bytes': cost.comm_bytes(choice)})
    for name, moves in cost.moves(choice, list(mesh)).items():
        plan.nodes[name]['moves'] = moves
    if stages > 1:
        plan.pipeline = plan_cut(space, cost, choice, stages)
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
                     level: str, device: str, stages: int) -> Plan:
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
                               device=device, stages=stages).to_json()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            if not distributed:
                raise
            result[0] = exc
    if distributed:
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], Exception):
        raise result[0]
    return Plan.from_json(result[0])


def parallelize(model: nn.Module, example_inputs: Sequence[torch.Tensor], *,
                loss_fn: Optional[Callable] = None, mesh: MeshSpec = None,
                memory_gb: Optional[float] = None, level: str = 'fast',
                pins: Optional[Dict[str, Sequence[str]]] = None, plan: Optional[Plan] = None,
                cluster=None, pipeline: Optional[int] = None,
                autocast: Optional[torch.dtype] = None) -> Tuple[AutoParallelModel, Plan]:
    """Plan ``model`` for the launched ranks and return ``(parallel_model, plan)``.

    Every rank passes the same model (same weights) and the same full ``example_inputs``;
    ``loss_fn(output, *inputs)`` turns the output into the scalar loss (None: the model's
    output, or its ``.loss``, is the loss). ``autocast`` (torch.bfloat16 / torch.float16):
    capture under ``torch.autocast`` of that dtype, so the graph holds autocast's casts and
    the model's own (e.g. a loss upcast to fp32, a no-op in an fp32 capture) and is planned
    with its real dtypes; the model must then run under that autocast
    (``fp16=dict(mode='torch')``), and without it only without. See the module doc.

    Under a launched ``parallel.pipeline`` = P (``pipeline``, when given, must equal it) the
    graph is cut into the launch's P x chunks stages (``pipeline.py``): ``mesh`` spans the
    world / P ranks of one stage, ``example_inputs`` are one micro-batch, and the result is a
    :class:`PipelinedAutoModel` for the Engine's pipeline schedule. ``memory_gb`` then bounds
    the unpipelined plan of the whole graph on that mesh, which holds every parameter and one
    micro-batch's activations of every op; a 1F1B stage holds a 1 / P share of the parameters
    and at most P micro-batches of its 1 / P share of the activations."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    pipe_size, stages, pipe_rank = _pipeline_shape(pipeline)
    world = dist.get_world_size() if dist.is_initialized() else 1
    axes = resolve_mesh(plan.mesh if plan is not None and mesh is None else mesh,
                        world // pipe_size)
    if level not in LEVELS:
        raise ValueError(f'level must be one of {LEVELS}, got {level!r}')
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise ConfigError(f'autocast must be None, torch.bfloat16 or torch.float16, '
                          f'got {autocast!r}')
    device = 'cuda' if next(model.parameters()).is_cuda else 'cpu'
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        captured = capture(model, example_inputs, loss_fn)
    if plan is None:
        plan = _search_on_rank0(captured, axes, pins, cluster, memory_gb, level, device, stages)
    elif plan.graph and plan.graph != fingerprint(captured.graph):
        raise ValueError(
            f'this plan was made for another graph (fingerprint {plan.graph}, this model\'s '
            f'capture {fingerprint(captured.graph)}, stamped repeated blocks: '
            f'{captured.stamped or "none"}): a plan applies to the model, input shapes and '
            f'capture it was made for (docs/auto_graph.md); plan the model again')
    elif plan.pipeline.get('stages', 1) != stages:
        raise ValueError(f'this plan cuts the graph into {plan.pipeline.get("stages", 1)} '
                         f'pipeline stage(s) but the launch runs {stages}; plan it again')
    placements = {k: tuple(placement_from_name(p) for p in v) for k, v in plan.params.items()}
    if stages == 1:
        device_mesh = init_device_mesh(device, tuple(axes.values()), mesh_dim_names=tuple(axes))
        distribute_parameters(model, device_mesh, placements)
        return AutoParallelModel(model, captured, device_mesh, plan, autocast), plan
    full = init_device_mesh(device, (pipe_size,) + tuple(axes.values()),
                            mesh_dim_names=('pipe',) + tuple(axes))
    _check_pipe_axis(full)
    device_mesh = full[tuple(axes)]
    graphs = split(captured, plan.pipeline['starts'])
    held = set().union(*(graphs[s].params for s in range(pipe_rank, stages, pipe_size)))
    _drop_parameters(model, held)
    distribute_parameters(model, device_mesh, placements)
    return PipelinedAutoModel(model, captured, device_mesh, plan, graphs, pipe_rank, pipe_size,
                              autocast), plan


def _pipeline_shape(pipeline: Optional[int]) -> Tuple[int, int, int]:
    """(pipeline size, stages, this rank's pipeline coordinate) of the launch."""
    ctx = current_context()
    settings = ctx.pipeline if ctx.layout is not None else None
    size = settings.size if settings is not None else 1
    if pipeline not in (None, size):
        raise ConfigError(f'parallelize(pipeline={pipeline!r}) needs a launch with '
                          f'parallel=dict(pipeline={pipeline}, ...): the pipeline runtime runs '
                          f'over the launched PIPELINE groups, and this launch has pipeline '
                          f'= {size}')
    if size == 1:
        return 1, 1, 0
    if ctx.layout.tensor != 1 or ctx.layout.expert != 1:
        raise ConfigError(f'a graph plan over pipeline stages takes its mesh from the ranks of '
                          f'one stage: launch with parallel=dict(pipeline={size}) and the rest '
                          f'as data (no hand tensor layout), got tensor size '
                          f"{ctx.layout.tensor} and expert size {ctx.layout.expert}")
    return size, settings.stages, ctx.axis(ParallelMode.PIPELINE).rank


def _check_pipe_axis(mesh) -> None:
    """The mesh's pipe axis must be the launch's PIPELINE group (the runtime sends over it)."""
    launched = tuple(current_context().axis(ParallelMode.PIPELINE).ranks)
    mine = tuple(int(r) for r in mesh['pipe'].mesh.tolist())
    if launched != mine:
        raise RuntimeError(f'the device mesh\'s pipe axis {mine} is not the launched PIPELINE '
                           f'group {launched}')


def _drop_parameters(model: nn.Module, held) -> None:
    """Remove from ``model`` every parameter no name of which is in ``held`` (another pipeline
    rank's stages hold it)."""
    names_of: Dict[int, List[str]] = {}
    for fqn, value in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(value), []).append(fqn)
    for fqns in names_of.values():
        if not any(f in held for f in fqns):
            for fqn in fqns:
                owner, name = _owner(model, fqn)
                owner._parameters[name] = None
