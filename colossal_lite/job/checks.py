"""Everything about a job that can fail before its processes start, run once in the
launching process: the job against a layout (:func:`check_layout`, with a build on the
meta device cut exactly as the run cuts it), the directories it writes
(:func:`check_paths`) and its data (:func:`prepare_data`: for ``hf`` the tokenizer trained
and the text packed into ``datasets``' cache). Each failure is a ``ConfigError`` naming the
config key."""
from __future__ import annotations

import os
from typing import Optional

from ..config import AutoSettings, ConfigError, PipelineSettings
from ..config.families import family
from ..config.job import JobSpec
from ..data.hf import check_source, hf_datasets
from ..data.text import corpus_files
from ..models import ModelLoss, SizeRule, hf_causal_lm, hf_config, hf_sizes
from ..trainer.hooks import tensorboard_available
from .build import describe_model, resolve_vocab

SPLIT_NOUNS = {'head': 'attention heads', 'hidden': 'hidden dimension', 'vocab': 'vocabulary',
               'sequence': 'sequence', 'batch': "replica's batch"}


def check_layout(spec: JobSpec, layout, pipeline: Optional[PipelineSettings] = None,
                 auto: Optional[AutoSettings] = None):
    """Every check of ``spec`` against ``layout`` (with its data size) and ``pipeline`` (the
    run's pipeline settings; default: ``layout.pipeline`` uniform stages, M = 1) that can fail
    before a process starts, each a ConfigError naming the config key (with ``auto``, the
    ``parallel.auto`` section: :func:`check_auto` instead):

    * ``train.global_batch_size`` (samples per optimizer step) divisible by the data size
      times M, each replica's micro-batch by the tensor family's ``batch_split``;
      ``data.seq_len`` by its ``sequence_split``;
    * ``parallel.expert`` dividing the data size;
    * the model's :class:`~colossal_lite.models.SizeRule` s (heads, hidden, vocabulary,
      image / patch, tokens) against the family's splits (``config/families.py``), and its
      entry's ``check(options, layout)`` (Llama: ``model.moe``, ``model_zoo.llama.check_moe``);
    * at least one block per pipeline stage: ``model.<layers>`` >= P * V; an explicit
      ``partition`` sums to ``model.<layers>``;
    * the model built on the meta device for the described layout and pipeline (rank 0 and
      the last rank), so any split error left is caught here too (named ``model``).
    """
    pipeline = pipeline or PipelineSettings(size=layout.pipeline)
    layout.check_expert()   # 'parallel.expert' divides the data size
    if spec.entry.builder is hf_causal_lm:
        check_hf_model(spec, layout, auto is not None)
    if auto is not None:
        return check_auto(spec, layout, pipeline, auto)
    microbatches, stages, partition = pipeline.num_microbatches, pipeline.stages, pipeline.partition
    fam = family(layout.mode)
    batch = spec.train.global_batch_size
    if batch % layout.data:
        raise ConfigError(f"'train.global_batch_size' = {batch} must be divisible by the "
                          f"data-parallel size {layout.data} (= {layout.world_size} processes / "
                          f"(pipeline*tensor = {layout.pipeline * layout.tensor}))")
    if (batch // layout.data) % microbatches:
        raise ConfigError(f"'train.global_batch_size' = {batch} must be divisible by the "
                          f"data-parallel size {layout.data} x num_microbatches {microbatches} "
                          f"(each replica's batch is cut into {microbatches} micro-batches)")
    split = fam.batch_split(layout)
    micro = batch // layout.data // microbatches
    if micro % split:
        raise ConfigError(f"tensor mode {layout.mode!r} splits each replica's micro-batch of "
                          f"{micro} (global batch / data size / num_microbatches) {split} ways: "
                          f"make 'train.global_batch_size' a multiple of "
                          f"{split * layout.data * microbatches}")
    rules = list(spec.entry.size_rules(spec.options))
    if spec.is_text:
        rules.append(SizeRule('data.seq_len', spec.data.seq_len, 'sequence'))
    for rule in rules:
        check_rule(rule, layout, fam)
    if spec.entry.check is not None:   # e.g. Llama's moe: top_k, experts by parallel.expert
        spec.entry.check(spec.options, layout)
    layers_key = spec.entry.layers
    if stages > 1 and layers_key in spec.options and spec.options[layers_key] < stages:
        raise ConfigError(f"'model.{layers_key}' = {spec.options[layers_key]} is fewer than the "
                          f"{stages} pipeline stages (parallel.pipeline size x chunks): every "
                          f"stage needs at least one block")
    if isinstance(partition, (list, tuple)) and layers_key in spec.options \
            and sum(partition) != spec.options[layers_key]:
        raise ConfigError(f"'parallel.pipeline.partition' = {list(partition)} must sum to "
                          f"'model.{layers_key}' = {spec.options[layers_key]} (blocks per "
                          f"stage), got {sum(partition)}")
    for rank in sorted({0, layout.world_size - 1}):
        _describe(spec, layout, rank, pipeline)


def _describe(spec: JobSpec, layout, rank: int, pipeline: PipelineSettings):
    try:
        describe_model(spec, layout, rank, pipeline)
    except ValueError as err:
        raise ConfigError(f"'model' ({spec.kind}, preset {spec.model.preset!r}) cannot "
                          f"be built for {layout_text(layout)} (rank {rank}): {err}") from None


def check_auto(spec: JobSpec, layout, pipeline: PipelineSettings, auto: AutoSettings):
    """The job under ``parallel.auto`` (every rank reads the whole batch; the plan splits
    it): the mesh spans exactly the launched world (one pipeline stage's ranks under
    ``parallel.pipeline``: the graph is cut into its stages), the model's forward returns its loss
    (what ``auto.parallelize`` captures), M divides the global batch, and the model builds
    on the meta device. Which plan fits ``memory_gb`` is known only after the capture, in
    the workers (``auto.NoPlanFits``)."""
    world = layout.world_size // layout.pipeline      # the ranks of one pipeline stage
    if auto.devices is not None and auto.devices != world:
        staged = (f' / pipeline {layout.pipeline} = {world} per stage'
                  if layout.pipeline > 1 else '')
        raise ConfigError(f"'parallel.auto.mesh' = {auto.mesh_text()} spans {auto.devices} "
                          f"processes but the job launches {layout.world_size}{staged}: the "
                          f"product of the mesh's axes must equal the world size (divided by "
                          f"the pipeline size) (launch {auto.devices * layout.pipeline} "
                          f"processes, e.g. --nproc {auto.devices * layout.pipeline}, or "
                          f"change the mesh)")
    if spec.entry.loss is not ModelLoss:
        raise ConfigError(f"'parallel.auto' plans a model whose forward returns its own loss "
                          f"(model type 'hf'); model type {spec.kind!r} returns outputs for a "
                          f"separate criterion: use a hand layout for it")
    batch, microbatches = spec.train.global_batch_size, pipeline.num_microbatches
    if batch % microbatches:
        raise ConfigError(f"'train.global_batch_size' = {batch} must be divisible by "
                          f"num_microbatches {microbatches}")
    _describe(spec, layout, 0, pipeline)


def check_hf_model(spec: JobSpec, layout, auto: bool = False):
    """``model=dict(type='hf', ...)``: its config readable, its vocabulary holding the
    data's tokens and its positions the sequence; no hand tensor layout, and no pipeline
    but under ``auto`` (the model is a plain torch module: data parallel, or
    ``parallel.auto``, whose graph is cut into the pipeline's stages)."""
    try:
        sizes = hf_sizes(hf_config(**spec.options))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if layout.tensor > 1 or (layout.pipeline > 1 and not auto):
        raise ConfigError(f"model type 'hf' runs a transformers model as it is: it takes no "
                          f"hand layout ({layout_text(layout)}); split it with "
                          f"parallel=dict(auto=dict(mesh=...)) or train it data parallel")
    vocab, need = sizes['vocab'], 256 if spec.data_type == 'shakespeare' else None
    if vocab is not None and need is not None and vocab < need:
        raise ConfigError(f"the 'hf' model's vocab_size = {vocab} must be at least 256, the "
                          f"byte tokenizer's vocabulary of data type 'shakespeare'")
    positions, seq = sizes['positions'], spec.data.seq_len
    if positions is not None and seq is not None and seq > positions:
        raise ConfigError(f"'data.seq_len' = {seq} exceeds the 'hf' model's "
                          f"{positions} positions (max_position_embeddings)")


def check_rule(rule: SizeRule, layout, fam):
    """``rule``'s value divisible by its layout split (or its int), or -- ``rule.or_divides``
    in a family that replicates that split's items (``fam.replicates``) -- dividing it;
    ConfigError otherwise."""
    named = f"'{rule.key}'" + (f' ({rule.what})' if rule.what else '')
    if isinstance(rule.by, str):
        n = getattr(fam, f'{rule.by}_split')(layout)
        if rule.value % n == 0:
            return
        replicates = rule.or_divides and rule.by in fam.replicates
        if replicates and n % rule.value == 0:
            return
        either = (f' or dividing {n} (it replicates them per group of ranks)' if replicates
                  else '')
        raise ConfigError(f"tensor mode {layout.mode!r} splits the {SPLIT_NOUNS[rule.by]} "
                          f"{n} ways ({layout_text(layout)}): it needs {named} divisible "
                          f"by {n}{either}, got {rule.value}")
    elif rule.value % rule.by:
        raise ConfigError(f"{named} = {rule.value} must be divisible by "
                          f"'{rule.by_key or rule.by}' = {rule.by}")


def layout_text(layout) -> str:
    expert = f' expert={layout.expert}' if getattr(layout, 'expert', 1) > 1 else ''
    return (f'data={layout.data}{expert} pipeline={layout.pipeline} tensor={layout.tensor} '
            f'({layout.mode or "none"}' + (f', depth {layout.depth})' if layout.mode == '2.5d' else ')'))


def check_paths(spec: JobSpec):
    """Create the directories the run writes (``train.run_dir``, the checkpoint's directory,
    ``log.tensorboard``) and check they are writable: a ConfigError naming the key now
    instead of a crash at the first save."""
    dirs = []
    if spec.checkpoint:
        dirs.append(('checkpoint.path', os.path.dirname(spec.checkpoint.path) or '.'))
    if spec.log.tensorboard is not None:
        if not tensorboard_available():
            raise ConfigError("'log.tensorboard' needs the tensorboard package (pip install "
                              "tensorboard)")
        dirs.append(('log.tensorboard', spec.log.tensorboard))
    dirs.append(('train.run_dir', spec.run_dir))
    for key, folder in dirs:
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ConfigError(f"'{key}': {folder!r} is a file, not a directory")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"'{key}': cannot create the directory {folder!r}: "
                              f"{err.strerror or err}") from None
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"'{key}': the directory {folder!r} is not writable")


def check_data(spec: JobSpec) -> JobSpec:
    """The cheap checks of the data (no loading): the plays exist, an ``hf`` source's files
    exist; returns ``spec`` with a tokenizer file's vocabulary resolved (``resolve_vocab``)."""
    try:
        if spec.data.plays is not None:
            corpus_files(spec.data.plays)
        if spec.data.type == 'hf':
            check_source(spec.data)
            return resolve_vocab(spec)
    except ValueError as err:
        raise ConfigError(f"'data.plays': {err}" if spec.data.type == 'shakespeare'
                          else str(err)) from None
    return spec


def prepare_data(spec: JobSpec, microbatches: int = 1):
    """Everything about the data that takes time, done once: for ``hf``, load the text (the
    column checked), train or load the tokenizer, tokenize and pack into ``datasets``' cache
    (the workers then memory-map it); checks the tokenizer fits ``model.vocab_size`` and
    that the training blocks fill one global batch."""
    if spec.data_type != 'hf':
        return
    try:
        train, _, vocab = hf_datasets(spec.data, spec.run_dir)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model_vocab, key = spec.options.get('vocab_size'), "'model.vocab_size'"
    if spec.entry.builder is hf_causal_lm:
        model_vocab = hf_sizes(hf_config(**spec.options))['vocab']
        key = "the 'hf' model's vocab_size"
    if model_vocab is not None and model_vocab < vocab:
        raise ConfigError(f"{key} = {model_vocab} is smaller than the trained "
                          f"tokenizer's vocabulary of {vocab}")
    batch = spec.train.global_batch_size // microbatches
    if len(train) < batch:
        raise ConfigError(f"'data': {len(train)} training blocks of {spec.data.seq_len} "
                          f"tokens do not fill one micro-step's global batch of {batch} "
                          f"('train.global_batch_size'); give more text or a smaller "
                          f"'data.seq_len'")
