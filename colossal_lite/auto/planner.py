"""``plan(model, devices, memory_gb, cluster, batch, seq)``: the chosen layout as a config.

The search (``search.py``) costs every executable candidate; the plan is the fastest that
fits, written as a config dict that ``colossal_lite.launch`` and ``colossal-lite train``
load (``parallel``, ``num_microbatches``, ``zero``, ``model``; ``data`` and ``train`` when
the model trains on a bundled data set), checked by ``job.check_layout`` (its divisibility
rules and a meta build of the model for the layout). Runners-up are the best candidate of
each other (tensor mode, pipeline size) and the smallest that do not fit, each with the
reason it lost.
"""
from __future__ import annotations

import pprint
from dataclasses import dataclass, field, replace
from typing import List, Optional

from ..config import ConfigError, load_config
from ..job import check_layout
from ..models import get_model
from .cluster import ClusterProfile, load_profile
from .cost import Candidate, Estimate, block_memory, evaluate, in_flight, stage_ranges
from .model_spec import ModelShape, model_shape, resolve_model_name
from .offload import is_offloaded
from .search import SearchResult, bmw_partition, dp_layers, job_spec, search

GiB = 2 ** 30


def _size(nbytes: float) -> str:
    return f'{nbytes / GiB:.2f} GiB' if nbytes >= 0.1 * GiB else f'{nbytes / 2 ** 20:.1f} MiB'


@dataclass
class Plan:
    """The chosen ``config`` with its ``estimate``; ``runners_up`` as (estimate, reason);
    ``per_layer``: :func:`per_layer_choices` (the BMW cut and the per-block checkpoint set,
    written into ``config`` where they differ from the candidate's uniform choices; the
    ``estimate`` stays the candidate's)."""

    config: dict
    estimate: Estimate
    runners_up: List[tuple]
    search: SearchResult
    cluster: ClusterProfile
    per_layer: dict = field(default_factory=dict)

    @property
    def step_time(self) -> float:
        return self.estimate.step_time

    @property
    def memory_per_device(self) -> float:
        return self.estimate.peak_memory

    def report(self) -> str:
        e = self.estimate
        lines = [f'cluster: {self.cluster.name}, {self.cluster.devices} devices',
                 f'searched {self.search.evaluated} candidates: {len(self.search.feasible)} fit '
                 f'{self.search.budget / GiB:.1f} GiB per device',
                 f'chosen: {e.candidate.describe()}',
                 f'  predicted step time {e.step_time * 1e3:.2f} ms, memory per device '
                 f'{_size(e.peak_memory)} (per stage: ' + ', '.join(map(_size, e.memory)) + ')',
                 f'  bubble {e.terms["bubble"] * 1e3:.2f} ms, exposed gradient sync '
                 f'{e.terms["exposed_sync"] * 1e3:.2f} ms, tensor comm per block '
                 f'{e.terms["block_comm"] * 1e3:.3f} ms']
        if 'offload' in e.terms:
            lines.append(f'  host offload {e.terms["offload"] * 1e3:.2f} ms per step, '
                         f'{_size(max(e.terms["host_bytes"]))} per rank on the host: '
                         + _why_offloaded(self.search, e))
        if self.per_layer:
            lines.append(f'  per-layer: {self.per_layer["note"]}')
        if self.search.skipped:   # the layouts the model's sizes refuse, one per mode
            lines.append(f"skipped {len(self.search.skipped)} layouts the model's sizes "
                         f"refuse, e.g.:")
            lines += [f'  {_layout_name(layout)}: {why}'
                      for layout, why in _skipped_examples(self.search.skipped)]
        lines.append('runners-up:')
        for est, why in self.runners_up:
            lines.append(f'  {est.candidate.describe():<60} {est.step_time * 1e3:9.2f} ms '
                         f'{_size(est.peak_memory):>10}  {why}')
        lines.append('config:')
        lines.append(pprint.pformat(self.config, sort_dicts=False, width=100))
        return '\n'.join(lines)

    def to_py(self) -> str:
        """The config as a ``.py`` file for ``colossal-lite train``."""
        e = self.estimate
        head = (f'"""Planned by colossal-lite plan: {e.candidate.describe()}.\n\n'
                f'Predicted step time {e.step_time * 1e3:.2f} ms, memory per device '
                f'{_size(e.peak_memory)} on {self.cluster.name}.\n"""\n')
        body = ''.join(f'{k} = {pprint.pformat(v, sort_dicts=False, width=90)}\n'
                       for k, v in self.config.items())
        return head + body


def plan_config(shape: ModelShape, cand: Candidate, batch: int, partition=None,
                checkpoint=None) -> dict:
    """The config dict of ``cand`` (module doc); ``partition`` (blocks per stage) and
    ``checkpoint`` (sorted block indices), when given, replace the candidate's named partition
    and all-or-none checkpointing (the per-layer choices of :func:`per_layer_choices`)."""
    l = cand.layout
    parallel = dict(data=l.data)
    if getattr(l, 'expert', 1) > 1:   # expert groups carved out of the data axis
        parallel['expert'] = l.expert
    if l.pipeline > 1:
        parallel['pipeline'] = dict(size=l.pipeline, chunks=cand.chunks, schedule=cand.schedule,
                                    partition=list(partition) if partition else cand.partition)
    if l.mode is not None:
        parallel['tensor'] = dict(size=l.tensor, mode=l.mode)
        if l.mode == '2.5d':
            parallel['tensor']['depth'] = l.depth
        if l.mode == 'ulysses' and l.ring > 1:   # the ring x Ulysses hybrid
            parallel['tensor']['ring'] = l.ring
    config = dict(parallel=parallel, num_microbatches=cand.microbatches)
    if cand.zero:
        config['zero'] = (dict(stage=cand.zero) if cand.zero < 3
                          else dict(stage=3, placement=cand.placement))
        if cand.zero == 3 and cand.placement == 'static':
            config['zero']['device_fraction'] = cand.device_fraction
        if cand.zero < 3 and cand.offload_optimizer:
            config['zero']['offload_optimizer'] = True
    entry = get_model(shape.kind)
    model = dict(type=shape.kind, preset=shape.preset)
    defaults = dict(entry.presets.get(shape.preset, {})) if shape.preset is not None else {}
    model.update({k: v for k, v in shape.opts.items() if defaults.get(k, object()) != v})
    if checkpoint is not None:
        model['checkpoint'] = list(checkpoint)
    elif cand.checkpoint:
        model['checkpoint'] = True
    # the package that registered the model, so the config also runs without the entry point
    config['imports'] = [entry.builder.__module__.split('.')[0]]
    config['model'] = model
    data = bundled_data(shape, config['imports'], model, batch)
    if data is not None:
        config['data'] = data
    config['train'] = dict(global_batch_size=batch)
    return config


def bundled_data(shape: ModelShape, imports, model: dict, batch: int) -> Optional[dict]:
    """The ``data`` section of the bundled data set the model registered with (its entry's
    ``data``; text: ``seq_len`` the plan's sequence), when the job accepts it for the
    model's options (``settings.job``: e.g. an image set fixes the image size); else None."""
    kind = get_model(shape.kind).data
    if kind is None:
        return None
    data = dict(type=kind)
    if shape.traits.inputs == 'tokens':
        data['seq_len'] = shape.seq
    try:
        load_config(dict(imports=imports, model=model, data=data,
                         train=dict(global_batch_size=batch))).settings.job
    except ConfigError:
        return None
    return data


def check_plan(shape: ModelShape, cand: Candidate, batch: int, **per_layer):
    """The checks ``colossal-lite train`` runs on the plan's config (``per_layer``: the
    ``partition`` / ``checkpoint`` of :func:`plan_config`): its typed sections
    (``load_config``), ``job.check_layout`` (size rules, batch splits, an explicit cut's sum
    and a meta build of the model on rank 0 and the last rank); ``load_config`` raises
    NotImplementedError for what ZeRO does not run."""
    settings = load_config(plan_config(shape, cand, batch, **per_layer)).settings
    spec = job_spec(shape, batch)
    if per_layer.get('checkpoint') is not None:
        spec = replace(spec, options=dict(spec.options, checkpoint=per_layer['checkpoint']))
    check_layout(spec, settings.layout.with_world_size(cand.layout.world_size), settings.pipeline)


def _why(est: Estimate, best: Estimate, budget: float) -> str:
    if est.peak_memory > budget:
        return f'does not fit: {_size(est.peak_memory)} > {_size(budget)}'
    slower = est.step_time / best.step_time - 1
    diffs = {'pipeline bubble': est.terms['bubble'] - best.terms['bubble'],
             'exposed gradient sync': est.terms['exposed_sync'] - best.terms['exposed_sync'],
             'tensor-parallel communication': est.terms['tensor_comm'] - best.terms['tensor_comm'],
             'expert-parallel all_to_all': est.terms.get('expert_comm', 0.0)
                 - best.terms.get('expert_comm', 0.0),
             'compute (recompute or more layers per rank)':
                 est.terms['compute'] - best.terms['compute'],
             'host offload (copies over the host link, CPU Adam)':
                 est.terms.get('offload', 0.0) - best.terms.get('offload', 0.0)}
    main = max(diffs, key=diffs.get)
    return f'{slower * 100:.1f}% slower, mostly {main}'


def _why_offloaded(result: SearchResult, best: Estimate) -> str:
    """Why an offloaded plan won: no device-placement candidate fits, or the fastest that
    does is slower."""
    on_device = [e for e in result.feasible if not is_offloaded(e.candidate)]
    if not on_device:
        return 'only an offloaded plan fits (no device placement fits)'
    return (f'the fastest device placement that fits ({on_device[0].candidate.describe()}) '
            f'is {(on_device[0].step_time / best.step_time - 1) * 100:.1f}% slower')


def _layout_name(layout) -> str:
    mode = layout.mode or 'none'
    if layout.mode == '2.5d':
        mode += f' d={layout.depth}'
    if layout.mode == 'ulysses' and layout.ring > 1:
        mode += f' R={layout.ring}'
    expert = f' E={layout.expert}' if getattr(layout, 'expert', 1) > 1 else ''
    return f'D={layout.data}{expert} P={layout.pipeline} t={layout.tensor}({mode})'


def _skipped_examples(skipped, count: int = 6):
    """One skipped layout per tensor mode (the first), at most ``count``."""
    seen, out = set(), []
    for layout, why in skipped:
        if layout.mode not in seen and len(out) < count:
            seen.add(layout.mode)
            out.append((layout, why))
    return out


def _runners_up(result: SearchResult, best: Estimate, count: int) -> List[tuple]:
    def key(l):
        return (l.mode, l.pipeline, l.tensor, l.ring, getattr(l, 'expert', 1))
    seen = {key(best.candidate.layout)}
    out = []
    for est in result.feasible:
        l = est.candidate.layout
        key_ = key(l)
        if key_ not in seen:
            seen.add(key_)
            out.append((est, _why(est, best, result.budget)))
        if len(out) >= count:
            break
    # the fastest fitting plan of the other kind (offloaded / device placement), if any
    other = next((e for e in result.feasible if e is not best and is_offloaded(e.candidate)
                  != is_offloaded(best.candidate)), None)
    if other is not None and all(other is not e for e, _ in out):
        out.append((other, _why(other, best, result.budget)))
    for est in result.infeasible[:2]:
        out.append((est, _why(est, best, result.budget)))
    return out


def _rank_blocks(ranges: List[range], p: int) -> List[List[int]]:
    """The serial block indices each pipeline rank holds (stage s on rank s % p)."""
    return [[i for s, r in enumerate(ranges) if s % p == rank for i in r] for rank in range(p)]


def _checkpoint_dp(shape: ModelShape, cluster: ClusterProfile, cand: Candidate, batch: int,
                   budget: float, ranges: List[range]) -> Optional[List[int]]:
    """Galvatron-BMW's per-stage DP (``dp_layers``) on each pipeline rank: the blocks to
    checkpoint that minimize its recompute time with its memory <= ``budget`` (none when the
    rank fits without); sorted serial indices, or None when some rank does not fit."""
    l = cand.layout
    micro = batch / l.data / cand.microbatches
    keep_ck, transient = block_memory(shape, l, micro, True)
    plain = evaluate(shape, cluster, replace(cand, checkpoint=False), batch, ranges=ranges)
    recompute = cand.microbatches * (plain.terms['block_forward']
                                     + plain.terms['block_comm'] / 2)
    chosen = []
    for rank, blocks in enumerate(_rank_blocks(ranges, l.pipeline)):
        if plain.memory[rank] <= budget:
            continue
        buffers = plain.terms['memory_buffers'][rank]   # memory.RankMemory
        # the device states: an offloaded candidate's model data moved (offload.apply)
        states = buffers.states + plain.memory[rank] - buffers.peak
        if not blocks or states + buffers.phase_b > budget:
            return None   # its gradients' peak does not fit whatever is recomputed
        held = in_flight(cand.schedule, l.pipeline, cand.microbatches, cand.chunks, rank)
        keep = buffers.activations / len(blocks)       # one block's share of phase A
        other = states + buffers.phase_a - buffers.activations
        options = [[(0.0, keep), (recompute, held * keep_ck)]] * len(blocks)
        _, picks = dp_layers(options, max(0.0, budget - other - transient))
        if not picks:
            return None
        chosen += [i for i, k in zip(blocks, picks) if k]
    return sorted(chosen)


def per_layer_choices(shape: ModelShape, cluster: ClusterProfile, best: Estimate, batch: int,
                      budget: float) -> dict:
    """The chosen layout's per-layer refinements: under a pipeline, the BMW cut
    (``bmw_partition`` from the parameter-balanced cut) when it predicts a faster step than the
    named partition (``partition``: blocks per stage); then the per-rank checkpoint DP on the
    cut (``checkpoint``: the block indices), when it differs from the candidate's all-or-none
    flag. Both go into the plan's config; ``note`` says what was chosen."""
    cand = best.candidate
    l = cand.layout
    ranges = stage_ranges(shape, cand.stages, cand.partition)
    out, notes = {}, []
    if l.pipeline > 1:
        def estimate(cut):
            return evaluate(shape, cluster, cand, batch, ranges=cut)
        start = [len(r) for r in stage_ranges(shape, cand.stages, 'parameters')]
        cut = bmw_partition(start, lambda r: estimate(r).peak_memory <= budget,
                            lambda r: estimate(r).stage_time)
        sizes, bmw_time = [len(r) for r in cut], estimate(cut).step_time
        out.update(bmw_partition=sizes, bmw_step_time=bmw_time)
        if sizes != [len(r) for r in ranges] and bmw_time < best.step_time:
            ranges, out['partition'] = cut, sizes
            notes.append(f'BMW cut {sizes} ({bmw_time * 1e3:.2f} ms) replaces {cand.partition!r}')
        else:
            notes.append(f'BMW cut {sizes} ({bmw_time * 1e3:.2f} ms) is no faster than '
                         f'{cand.partition!r}')
    picks = _checkpoint_dp(shape, cluster, cand, batch, budget, ranges)
    uniform = list(range(shape.layers)) if cand.checkpoint else []
    if picks is not None and picks != uniform:
        out['checkpoint'] = picks
        notes.append(f'checkpoint {len(picks)} of {shape.layers} blocks {picks}')
    else:
        notes.append(f'checkpoint {"all" if cand.checkpoint else "no"} blocks (the per-block DP '
                     f'agrees)' if picks is not None else 'no per-block checkpoint set fits')
    out['note'] = '; '.join(notes)
    return out


def plan(model: str, devices: int = 8, memory_gb: Optional[float] = None,
         cluster=None, batch: int = 8, seq: Optional[int] = None, runners_up: int = 5,
         **model_overrides) -> Plan:
    """The fastest executable plan (module doc). ``model``: a registered model's preset
    (model_zoo's 'gpt2-small', 'bert-base', 'vit-base', ...) or 'kind:preset';
    ``cluster``: None (the shipped 'nvlink8'), a shipped name, a JSON path or a
    ClusterProfile; ``memory_gb``: the budget per device (default: the profile's memory);
    ``batch``: the global batch; ``seq``: the sequence length (default the model's longest,
    ``PlannerShape.seq``)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f'devices must be a positive integer, got {devices!r}')
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f'batch must be a positive integer, got {batch!r}')
    if memory_gb is not None and not memory_gb > 0:
        raise ValueError(f'memory_gb must be positive, got {memory_gb!r}')
    profile = load_profile(cluster)
    profile = profile.with_devices(devices, memory_gb * GiB if memory_gb else None)
    kind, preset = resolve_model_name(model)
    shape = model_shape(kind, preset, seq, **model_overrides)
    result = search(shape, profile, devices, batch)
    if result.best is None:
        smallest = result.infeasible[0] if result.infeasible else None
        hint = (f'; the smallest candidate ({smallest.candidate.describe()}) needs '
                f'{smallest.peak_memory / GiB:.2f} GiB' if smallest else
                '; no layout splits this model and batch over these devices')
        raise ValueError(f'no plan for {model} on {devices} devices fits '
                         f'{profile.memory_bytes / GiB:.2f} GiB per device{hint}')
    best = None
    for est in result.feasible:  # the first that passes check_layout (its meta build)
        try:
            check_plan(shape, est.candidate, batch)
        except (ConfigError, NotImplementedError):
            continue
        best = est
        break
    if best is None:
        raise ValueError(f'no candidate for {model} on {devices} devices passes check_layout')
    per_layer = per_layer_choices(shape, profile, best, batch, profile.memory_bytes)
    chosen = {k: per_layer[k] for k in ('partition', 'checkpoint') if k in per_layer}
    check_plan(shape, best.candidate, batch, **chosen)
    config = plan_config(shape, best.candidate, batch, **chosen)
    return Plan(config, best, _runners_up(result, best, runners_up), result, profile, per_layer)
