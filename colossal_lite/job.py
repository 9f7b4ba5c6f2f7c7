"""A training job described by a config's ``model``, ``data``, ``train``, ``optimizer``,
``lr_scheduler``, ``checkpoint``, ``log`` and ``imports`` keys: validated once into a frozen
:class:`JobSpec` (``cfg.settings.job``), checked against a layout (:func:`check_layout`,
with a build on the meta device), then built into the model, loss, data loaders,
optimizer and scheduler that ``colossal_lite.initialize`` takes.

Sections (every key optional except ``model.type`` and ``data.type``)::

    imports = ['my_models']                      # modules that register models (optional)
    model = dict(type=NAME, preset='tiny', **options)   # NAME registered in colossal_lite.models
    data = dict(type='shakespeare', seq_len=64, val_fraction=0.05, plays=None)
         | dict(type='hf', path='text'|'json'|'parquet'|'csv'|SAVED_DIR, data_files=GLOBS,
                split='train', text_column='text', seq_len=64, val_fraction=0.05,
                tokenizer=dict(type='bpe', vocab_size=4096) | dict(type='file', path=FILE))
         | dict(type='digits', test_fraction=0.2)
    train = dict(global_batch_size=16, steps=None, epochs=1, log_every=10,
                 eval_batches=None, shuffle_seed=0, run_dir=None)
    optimizer = dict(type='adamw' | 'adam' | 'sgd', lr=1e-3, weight_decay=0.0, ...)
    lr_scheduler = dict(type='cosine' | 'constant', warmup_steps=0, min_lr_ratio=0.1)
    checkpoint = dict(path='runs/ckpt', interval=100, async_save=False)  # run_state.py
    log = dict(tensorboard='runs/tb')                             # needs the tensorboard package

A model trains on the data set it was registered with; a model registered with
``shakespeare`` (a language model) also trains on ``hf`` (your own text, ``data/hf.py``).
``shakespeare`` (byte tokens) needs ``vocab_size >= 256`` and ``seq_len <= max_positions``
when the model has these options; ``hf`` needs ``vocab_size`` >= the tokenizer's
vocabulary (without a ``model.vocab_size`` it is set to that vocabulary rounded up to a
multiple of 128). ``train.run_dir`` (default: the checkpoint's directory, else ``runs``)
receives the trained tokenizer, ``metrics.jsonl`` and ``loss.png``. ``digits`` needs ``img_size=8, in_chans=1, num_classes=10`` when it has them.
Every bad value raises :class:`~colossal_lite.config.ConfigError` naming the key and the value.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from .config import ConfigError, _check_keys
from .models import ModelEntry, SizeRule, get_model, import_modules

DATA_TYPES = ('shakespeare', 'digits')          # what a model is registered to train on
TEXT_TYPES = ('shakespeare', 'hf')              # the data types of a 'shakespeare' model
_DATA_KEYS = {'shakespeare': {'type', 'seq_len', 'val_fraction', 'plays'},
              'hf': {'type', 'path', 'data_files', 'split', 'text_column', 'seq_len',
                     'val_fraction', 'tokenizer', 'cache_dir'},
              'digits': {'type', 'test_fraction'}}
_TOKENIZER_KEYS = {'bpe': {'type', 'vocab_size'}, 'file': {'type', 'path'}}
VOCAB_MULTIPLE = 128
_DIGITS_SHAPE = dict(img_size=8, in_chans=1, num_classes=10)
_TRAIN_KEYS = {'global_batch_size', 'steps', 'epochs', 'log_every', 'eval_batches', 'shuffle_seed',
               'run_dir'}
_OPTIMIZERS = {'adamw': {'lr', 'weight_decay', 'betas', 'eps'},
               'adam': {'lr', 'weight_decay', 'betas', 'eps'},
               'sgd': {'lr', 'weight_decay', 'momentum', 'nesterov'}}
_SCHEDULERS = {'cosine': {'type', 'warmup_steps', 'min_lr_ratio'}, 'constant': {'type', 'warmup_steps'}}


@dataclass(frozen=True)
class JobSpec:
    """The validated job sections (plain dicts with defaults filled in); ``options`` are the
    model's resolved options (preset + overrides)."""

    model: Dict[str, Any]
    options: Dict[str, Any]
    data: Dict[str, Any]
    train: Dict[str, Any]
    optimizer: Dict[str, Any]
    lr_scheduler: Dict[str, Any] = field(default_factory=lambda: {'type': 'constant'})
    checkpoint: Dict[str, Any] = field(default_factory=dict)
    log: Dict[str, Any] = field(default_factory=dict)
    imports: Tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """The registered model name (``model.type``)."""
        return self.model['type']

    @property
    def entry(self) -> ModelEntry:
        return get_model(self.kind)

    @property
    def data_type(self) -> str:
        return self.data['type']

    @property
    def is_text(self) -> bool:
        """Whether samples are token sequences (throughput in tokens/s)."""
        return self.data_type in TEXT_TYPES

    @property
    def run_dir(self) -> str:
        """Where the trained tokenizer, ``metrics.jsonl`` and ``loss.png`` go."""
        return self.train['run_dir']

    def with_steps(self, steps: Optional[int]) -> 'JobSpec':
        """This job with ``train.steps`` replaced (``--steps``); unchanged for None."""
        if steps is None:
            return self
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ConfigError(f'--steps must be a positive integer, got {steps}')
        return dataclasses.replace(self, train=dict(self.train, steps=int(steps)))


def _section(config: Mapping, key: str, required: bool) -> Dict[str, Any]:
    value = config.get(key)
    if value is None:
        if required:
            raise ConfigError(f"the config needs a '{key}' section to train, e.g. {key}=dict(type=...)")
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"'{key}' must be a dict, got {value!r}")
    return dict(value)


def _number(section: Mapping, key: str, where: str, lo: float = 0.0, hi: float = math.inf,
            integer: bool = False, default=None):
    value = section.get(key, default)
    if value is None:
        return None
    ok = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    if not ok or not lo <= value <= hi:
        kind = 'an integer' if integer else 'a number'
        raise ConfigError(f"'{where}.{key}' must be {kind} in [{lo}, {hi}], got {value!r}")
    return value


def _parse_imports(config: Mapping) -> Tuple[str, ...]:
    names = config.get('imports') or ()
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"'imports' must be a list of module names, got {names!r}")
    try:
        import_modules(names)
    except ValueError as err:
        raise ConfigError(f"'imports': {err}") from None
    return tuple(names)


def _resolve_model(model: Mapping) -> Tuple[ModelEntry, Optional[str], Dict[str, Any]]:
    """(registry entry, preset, options) of a ``model`` section; ValueError when impossible."""
    entry = get_model(model['type'])
    preset = model.get('preset', 'tiny' if 'tiny' in entry.presets else None)
    overrides = {k: v for k, v in model.items() if k not in ('type', 'preset')}
    return entry, preset, entry.options(preset, overrides)


def _parse_model(config: Mapping) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the ``model`` section with its preset filled in, the model's resolved options)."""
    model = _section(config, 'model', required=True)
    kind = model.get('type')
    if not isinstance(kind, str):
        raise ConfigError(f"'model.type' must be the name of a registered model, got {kind!r}")
    try:
        get_model(kind)
    except ValueError as err:
        raise ConfigError(f"'model.type' = {kind!r}: {err}") from None
    try:
        _, model['preset'], options = _resolve_model(model)
    except ValueError as err:
        raise ConfigError(f"'model': {err}") from None
    return model, options


def _parse_data(config: Mapping, kind: str, options: Mapping) -> Dict[str, Any]:
    data = _section(config, 'data', required=True)
    want = get_model(kind).data
    if want not in DATA_TYPES:
        raise ConfigError(f"model type '{kind}' names no bundled data set to train on "
                          f"(registered with data={want!r}; one of {list(DATA_TYPES)} is needed)")
    if want == 'shakespeare' and data.get('type') == 'hf':
        return _parse_hf(config, data, options)
    if data.get('type') != want:
        also = " (or 'hf', your own text)" if want == 'shakespeare' else ''
        raise ConfigError(f"model type '{kind}' trains on data type '{want}'{also}, "
                          f"got 'data.type' = {data.get('type')!r}")
    _check_keys(data, _DATA_KEYS[want], 'data.')
    if want == 'shakespeare':
        vocab = options.get('vocab_size', 256)
        if vocab < 256:
            raise ConfigError(f"'model.vocab_size' = {vocab} must be at least 256, the byte "
                              f"tokenizer's vocabulary of data type 'shakespeare'")
        limit = options.get('max_positions', 1 << 20)
        data['seq_len'] = _number(data, 'seq_len', 'data', 2, limit, True, min(64, limit))
        data['val_fraction'] = _number(data, 'val_fraction', 'data', 1e-6, 0.5, default=0.05)
        if data.get('plays') is not None:
            from .data.text import corpus_files
            try:
                corpus_files(data['plays'])
            except ValueError as err:
                raise ConfigError(f"'data.plays': {err}") from None
    else:
        for key, need in _DIGITS_SHAPE.items():
            if options.get(key, need) != need:
                raise ConfigError(f"'model.{key}' = {options[key]!r} must be {need} for data type "
                                  f"'digits' (8x8 one-channel images of 10 classes)")
        data['test_fraction'] = _number(data, 'test_fraction', 'data', 1e-6, 0.9, default=0.2)
    return data


def _parse_hf(config: Mapping, data: Dict[str, Any], options: Dict[str, Any]) -> Dict[str, Any]:
    """The ``hf`` data section with defaults; sets ``options['vocab_size']`` from the tokenizer
    when the ``model`` section does not give it (see the module doc)."""
    from .data.hf import check_source, tokenizer_vocab
    _check_keys(data, _DATA_KEYS['hf'], 'data.')
    limit = options.get('max_positions', 1 << 20)
    data['seq_len'] = _number(data, 'seq_len', 'data', 2, limit, True, min(64, limit))
    data['val_fraction'] = _number(data, 'val_fraction', 'data', 1e-6, 0.5, default=0.05)
    data.setdefault('split', 'train')
    data.setdefault('text_column', 'text')
    for key in ('split', 'text_column'):
        if not isinstance(data[key], str):
            raise ConfigError(f"'data.{key}' must be a string, got {data[key]!r}")
    tok = data.get('tokenizer')
    if not isinstance(tok, Mapping) or tok.get('type') not in _TOKENIZER_KEYS:
        raise ConfigError(f"'data.tokenizer' must be dict(type='bpe', vocab_size=V) or "
                          f"dict(type='file', path='tokenizer.json'), got {tok!r}")
    tok = data['tokenizer'] = dict(tok)
    _check_keys(tok, _TOKENIZER_KEYS[tok['type']], 'data.tokenizer.')
    if tok['type'] == 'bpe':
        tok['vocab_size'] = _number(tok, 'vocab_size', 'data.tokenizer', 260, 1 << 20, True, 4096)
    elif not (isinstance(tok.get('path'), str) and os.path.isfile(tok['path'])):
        raise ConfigError(f"'data.tokenizer.path' = {tok.get('path')!r} is not a file (relative "
                          f"paths are taken from {os.getcwd()})")
    try:
        check_source(data)
        vocab = tokenizer_vocab(data)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    given = config['model'].get('vocab_size')
    if given is None and 'vocab_size' in options:
        options['vocab_size'] = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif given is not None and given < vocab:
        raise ConfigError(f"'model.vocab_size' = {given} is smaller than the tokenizer's "
                          f"vocabulary of {vocab} ('data.tokenizer'); leave 'model.vocab_size' "
                          f"out to take {-(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE}")
    return data


def _parse_train(config: Mapping) -> Dict[str, Any]:
    train = _section(config, 'train', required=False)
    _check_keys(train, _TRAIN_KEYS, 'train.')
    out = dict(global_batch_size=_number(train, 'global_batch_size', 'train', 1, 1 << 30, True, 16),
               steps=_number(train, 'steps', 'train', 1, 1 << 40, True),
               epochs=_number(train, 'epochs', 'train', 1, 1 << 20, True, 1),
               log_every=_number(train, 'log_every', 'train', 1, 1 << 30, True, 10),
               eval_batches=_number(train, 'eval_batches', 'train', 1, 1 << 30, True),
               shuffle_seed=_number(train, 'shuffle_seed', 'train', 0, 1 << 62, True, 0))
    run_dir = train.get('run_dir')
    if run_dir is not None and not isinstance(run_dir, str):
        raise ConfigError(f"'train.run_dir' must be a directory name, got {run_dir!r}")
    ckpt = config.get('checkpoint')
    if run_dir is None and isinstance(ckpt, Mapping) and isinstance(ckpt.get('path'), str):
        run_dir = os.path.dirname(ckpt['path'])
    out['run_dir'] = run_dir or 'runs'
    return out


def _parse_optimizer(config: Mapping) -> Dict[str, Any]:
    opt = _section(config, 'optimizer', required=False)
    opt.setdefault('type', 'adamw')
    if opt['type'] not in _OPTIMIZERS:
        raise ConfigError(f"'optimizer.type' must be one of {sorted(_OPTIMIZERS)}, got {opt['type']!r}")
    _check_keys(opt, _OPTIMIZERS[opt['type']] | {'type'}, 'optimizer.')
    opt['lr'] = _number(opt, 'lr', 'optimizer', 0.0, 10.0, default=1e-3)
    _number(opt, 'weight_decay', 'optimizer', 0.0, 1.0)
    _number(opt, 'eps', 'optimizer', 0.0, 1.0)
    _number(opt, 'momentum', 'optimizer', 0.0, 1.0)
    if 'betas' in opt:
        betas = opt['betas']
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, numbers.Real) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"'optimizer.betas' must be two numbers in [0, 1), got {betas!r}")
    return opt


def _parse_checkpoint(config: Mapping) -> Dict[str, Any]:
    ckpt = _section(config, 'checkpoint', required=False)
    if ckpt:
        _check_keys(ckpt, {'path', 'interval', 'async_save'}, 'checkpoint.')
        if not isinstance(ckpt.setdefault('async_save', False), bool):
            raise ConfigError(f"'checkpoint.async_save' must be True or False, got "
                              f"{ckpt['async_save']!r}")
        path = ckpt.get('path')
        if not isinstance(path, str) or not path or '{' in path:
            raise ConfigError(f"'checkpoint.path' must be a directory name such as 'runs/ckpt' "
                              f"(each save replaces it atomically), got {path!r}")
        ckpt['interval'] = _number(ckpt, 'interval', 'checkpoint', 1, 1 << 40, True, 100)
    return ckpt


def _parse_log(config: Mapping) -> Dict[str, Any]:
    log = _section(config, 'log', required=False)
    _check_keys(log, {'tensorboard'}, 'log.')
    if 'tensorboard' in log:
        from .trainer.hooks import tensorboard_available
        if not isinstance(log['tensorboard'], str):
            raise ConfigError(f"'log.tensorboard' must be a directory, got {log['tensorboard']!r}")
        if not tensorboard_available():
            raise ConfigError("'log.tensorboard' needs the tensorboard package (pip install "
                              "tensorboard)")
    return log


def _parse_scheduler(config: Mapping) -> Dict[str, Any]:
    sched = _section(config, 'lr_scheduler', required=False)
    sched.setdefault('type', 'constant')
    if sched['type'] not in _SCHEDULERS:
        raise ConfigError(f"'lr_scheduler.type' must be one of {sorted(_SCHEDULERS)}, "
                          f"got {sched['type']!r}")
    _check_keys(sched, _SCHEDULERS[sched['type']], 'lr_scheduler.')
    sched['warmup_steps'] = _number(sched, 'warmup_steps', 'lr_scheduler', 0, 1 << 40, True, 0)
    if sched['type'] == 'cosine':
        sched['min_lr_ratio'] = _number(sched, 'min_lr_ratio', 'lr_scheduler', 0.0, 1.0, default=0.1)
    return sched


def parse_job(config: Mapping) -> JobSpec:
    """Validate the job sections of a config (see the module doc); ``cfg.settings.job``
    calls this once per config."""
    imports = _parse_imports(config)
    model, options = _parse_model(config)
    return JobSpec(model=model, options=options, data=_parse_data(config, model['type'], options),
                   train=_parse_train(config), optimizer=_parse_optimizer(config),
                   lr_scheduler=_parse_scheduler(config), checkpoint=_parse_checkpoint(config),
                   log=_parse_log(config), imports=imports)


# ---------------------------------------------------------------------------- building
def build_model(model):
    """The registered model of a :class:`JobSpec` (or of a ``model`` section), built for the
    current context: ``builder(**options)``."""
    if isinstance(model, JobSpec):
        return model.entry.builder(**model.options)
    entry, _, options = _resolve_model(model)
    return entry.builder(**options)


def build_criterion(spec: JobSpec):
    """The loss the model was registered with (default: ``colossal_lite.nn.CrossEntropyLoss``)."""
    from .nn import CrossEntropyLoss
    return (spec.entry.loss or CrossEntropyLoss)()


def build_data(spec: JobSpec, device: Optional[torch.device] = None, microbatches: int = 1):
    """(train loader, test loader, items per sample) with each DATA rank's slice of each batch.
    The train loader yields micro-batches: ``global_batch_size / microbatches`` samples, so
    one optimizer step (M of them) sees ``global_batch_size`` samples."""
    from .data import DataParallelLoader, digits_datasets, text_datasets
    if spec.data_type == 'shakespeare':
        seq_len = spec.data['seq_len']
        train, test = text_datasets(seq_len, spec.data['val_fraction'], spec.data.get('plays'))
        per_sample = seq_len
    elif spec.data_type == 'hf':
        from .data.hf import hf_datasets
        train, test, _ = hf_datasets(spec.data, spec.run_dir)
        per_sample = spec.data['seq_len']
    else:
        train, test = digits_datasets(spec.data['test_fraction'])
        per_sample = 1
    batch, seed = spec.train['global_batch_size'], spec.train['shuffle_seed']
    return (DataParallelLoader(train, batch // microbatches, shuffle=True, seed=seed,
                               device=device),
            DataParallelLoader(test, batch, shuffle=False, device=device), per_sample)


def build_optimizer(spec: JobSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = dict(spec.optimizer)
    kind = opt.pop('type')
    if 'betas' in opt:
        opt['betas'] = tuple(opt['betas'])
    cls = {'adamw': torch.optim.AdamW, 'adam': torch.optim.Adam, 'sgd': torch.optim.SGD}[kind]
    return cls(model.parameters(), **opt)


def build_scheduler(spec: JobSpec, optimizer, total_steps: int):
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio``."""
    sched = spec.lr_scheduler
    warmup = sched['warmup_steps']
    floor = sched.get('min_lr_ratio', 1.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if sched['type'] == 'constant':
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------- job vs layout
_SPLIT_NOUNS = {'head': 'attention heads', 'hidden': 'hidden dimension', 'vocab': 'vocabulary',
                'sequence': 'sequence', 'batch': "replica's batch"}


def check_layout(spec: JobSpec, layout, stages: int = 1, microbatches: int = 1,
                 partition=None):
    """Every check of ``spec`` against ``layout`` (with its data size) that can fail before a
    process starts, each a ConfigError naming the config key:

    * ``train.global_batch_size`` (samples per optimizer step) divisible by the data size
      times ``microbatches`` (M), each replica's micro-batch by the tensor family's
      ``batch_split``; ``data.seq_len`` by its ``sequence_split``;
    * the model's :class:`~colossal_lite.models.SizeRule` s (heads, hidden, vocabulary,
      image / patch, tokens) against the family's splits (``families.py``);
    * at least one block per pipeline stage: ``model.<layers>`` >= ``stages`` (P * V); an
      explicit ``partition`` (``parallel.pipeline.partition``, blocks per stage: the
      ``PipelineSettings.partition`` tuple) sums to ``model.<layers>``;
    * the model built on the meta device for the described layout (rank 0 and the last
      rank), so any split error left is caught here too (named ``model``).
    """
    from .families import family
    fam = family(layout.mode)
    batch = spec.train['global_batch_size']
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
        rules.append(SizeRule('data.seq_len', spec.data['seq_len'], 'sequence'))
    for rule in rules:
        _check_rule(rule, layout, fam)
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
        try:
            describe_model(spec, layout, rank)
        except ValueError as err:
            raise ConfigError(f"'model' ({spec.kind}, preset {spec.model.get('preset')!r}) cannot "
                              f"be built for {_layout_text(layout)} (rank {rank}): {err}") from None


def _check_rule(rule: SizeRule, layout, fam):
    named = f"'{rule.key}'" + (f' ({rule.what})' if rule.what else '')
    if isinstance(rule.by, str):
        n = getattr(fam, f'{rule.by}_split')(layout)
        if rule.value % n:
            raise ConfigError(f"tensor mode {layout.mode!r} splits the {_SPLIT_NOUNS[rule.by]} "
                              f"{n} ways ({_layout_text(layout)}): it needs {named} divisible "
                              f"by {n}, got {rule.value}")
    elif rule.value % rule.by:
        raise ConfigError(f"{named} = {rule.value} must be divisible by "
                          f"'{rule.by_key or rule.by}' = {rule.by}")


def _layout_text(layout) -> str:
    return (f'data={layout.data} pipeline={layout.pipeline} tensor={layout.tensor} '
            f'({layout.mode or "none"}' + (f', depth {layout.depth})' if layout.mode == '2.5d' else ')'))


def describe_model(spec: JobSpec, layout, rank: int = 0) -> torch.nn.Module:
    """The job's model built on the meta device for ``layout`` as ``rank`` holds it, with no
    process group (``ParallelContext.describe``): local shapes and placements, no memory."""
    from .context import ParallelContext, use_context
    with use_context(ParallelContext.describe(layout, rank)), torch.device('meta'):
        return build_model(spec)


# ---------------------------------------------------------------------------- before the start
def check_paths(spec: JobSpec):
    """Create the directories the run writes (``train.run_dir``, the checkpoint's directory,
    ``log.tensorboard``) and check they are writable: a ConfigError naming the key now
    instead of a crash at the first save."""
    dirs = []
    if spec.checkpoint:
        dirs.append(('checkpoint.path', os.path.dirname(spec.checkpoint['path']) or '.'))
    if 'tensorboard' in spec.log:
        dirs.append(('log.tensorboard', spec.log['tensorboard']))
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


def prepare_data(spec: JobSpec, microbatches: int = 1):
    """Everything about the data that can fail or take time, done once in the parent: for
    ``hf``, load the text (the column checked), train or load the tokenizer, tokenize and pack
    into ``datasets``' cache (the workers then memory-map it); checks the tokenizer fits
    ``model.vocab_size`` and that the training blocks fill one global batch."""
    if spec.data_type != 'hf':
        return
    from .data.hf import hf_datasets
    try:
        train, _, vocab = hf_datasets(spec.data, spec.run_dir)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model_vocab = spec.options.get('vocab_size')
    if model_vocab is not None and model_vocab < vocab:
        raise ConfigError(f"'model.vocab_size' = {model_vocab} is smaller than the trained "
                          f"tokenizer's vocabulary of {vocab}")
    batch = spec.train['global_batch_size'] // microbatches
    if len(train) < batch:
        raise ConfigError(f"'data': {len(train)} training blocks of {spec.data['seq_len']} "
                          f"tokens do not fill one micro-step's global batch of {batch} "
                          f"('train.global_batch_size'); give more text or a smaller "
                          f"'data.seq_len'")
