"""The job sections of a config, what ``colossal-lite train`` runs: one frozen dataclass per
section, composed into a :class:`JobSpec` (``settings.job``). Pure: no file is read and
nothing is built here (``colossal_lite/job/``: ``build.py`` builds, ``checks.py`` checks
the job against a layout and prepares the data).

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
multiple of 128: at parse time for a BPE tokenizer, whose size is the config's; for a
tokenizer file when ``job.build.resolve_vocab`` reads it). ``train.run_dir`` (default: the
checkpoint's directory, else ``runs``) receives the trained tokenizer, ``metrics.jsonl``
and ``loss.png``. ``digits`` needs ``img_size=8, in_chans=1, num_classes=10`` when it has
them. Every bad value raises :class:`ConfigError` naming the key and the value.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from ..models import ModelEntry, get_model, import_modules
from .checks import ConfigError, check_keys, in_range, mapping, string, typed

DATA_TYPES = ('shakespeare', 'digits')          # what a model is registered to train on
TEXT_TYPES = ('shakespeare', 'hf')              # the data types of a 'shakespeare' model
DATA_KEYS = {'shakespeare': ('type', 'seq_len', 'val_fraction', 'plays'),
             'hf': ('type', 'path', 'data_files', 'split', 'text_column', 'seq_len',
                    'val_fraction', 'tokenizer', 'cache_dir'),
             'digits': ('type', 'test_fraction')}
TOKENIZER_KEYS = {'bpe': ('type', 'vocab_size'), 'file': ('type', 'path')}
VOCAB_MULTIPLE = 128
DIGITS_SHAPE = dict(img_size=8, in_chans=1, num_classes=10)
TRAIN_KEYS = ('global_batch_size', 'steps', 'epochs', 'log_every', 'eval_batches',
              'shuffle_seed', 'run_dir')
OPTIMIZERS = {'adamw': ('lr', 'weight_decay', 'betas', 'eps'),
              'adam': ('lr', 'weight_decay', 'betas', 'eps'),
              'sgd': ('lr', 'weight_decay', 'momentum', 'nesterov')}
SCHEDULERS = {'cosine': ('type', 'warmup_steps', 'min_lr_ratio'),
              'constant': ('type', 'warmup_steps')}
JOB_KEYS = ('imports', 'model', 'data', 'train', 'optimizer', 'lr_scheduler', 'checkpoint', 'log')


def round_vocab(vocab: int) -> int:
    """A tokenizer's vocabulary rounded up to a multiple of :data:`VOCAB_MULTIPLE`."""
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class ModelSection:
    """``model``: the registered ``type``, its ``preset`` (None: no preset) and the options
    the config gives on top of the preset."""

    type: str
    preset: Optional[str] = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def resolve(self) -> Tuple[ModelEntry, Dict[str, Any]]:
        """(registry entry, the preset's options updated by the overrides); ValueError on
        an unknown preset or option."""
        entry = get_model(self.type)
        return entry, entry.options(self.preset, dict(self.overrides))


@dataclass(frozen=True)
class TokenizerSection:
    """``data.tokenizer``: ``bpe`` trained on the text (``vocab_size``) or a ``file``."""

    type: str
    vocab_size: Optional[int] = None
    path: Optional[str] = None


@dataclass(frozen=True)
class DataSection:
    """``data``: ``shakespeare`` (byte tokens), ``hf`` (your own text) or ``digits``."""

    type: str
    seq_len: Optional[int] = None
    val_fraction: Optional[float] = None
    plays: Any = None
    path: Optional[str] = None
    data_files: Any = None
    split: str = 'train'
    text_column: str = 'text'
    tokenizer: Optional[TokenizerSection] = None
    cache_dir: Optional[str] = None
    test_fraction: Optional[float] = None


@dataclass(frozen=True)
class TrainSection:
    """``train``: samples per optimizer step, length (``steps`` or ``epochs``), logging."""

    global_batch_size: int = 16
    steps: Optional[int] = None
    epochs: int = 1
    log_every: int = 10
    eval_batches: Optional[int] = None
    shuffle_seed: int = 0
    run_dir: str = 'runs'


@dataclass(frozen=True)
class OptimizerSection:
    """``optimizer``: a torch optimizer ``type`` with ``lr`` and its other ``options``."""

    type: str = 'adamw'
    lr: float = 1e-3
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerSection:
    """``lr_scheduler``: linear warm-up, then ``constant`` or ``cosine`` decay."""

    type: str = 'constant'
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0


@dataclass(frozen=True)
class CheckpointSection:
    """``checkpoint``: the directory saved every ``interval`` steps and at the end."""

    path: str
    interval: int = 100
    async_save: bool = False


@dataclass(frozen=True)
class LogSection:
    """``log``: optional TensorBoard directory."""

    tensorboard: Optional[str] = None


@dataclass(frozen=True)
class JobSpec:
    """The validated job sections; ``options`` are the model's resolved options (preset +
    overrides)."""

    model: ModelSection
    options: Dict[str, Any]
    data: DataSection
    train: TrainSection
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    checkpoint: Optional[CheckpointSection] = None
    log: LogSection = field(default_factory=LogSection)
    imports: Tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """The registered model name (``model.type``)."""
        return self.model.type

    @property
    def entry(self) -> ModelEntry:
        return get_model(self.kind)

    @property
    def data_type(self) -> str:
        return self.data.type

    @property
    def is_text(self) -> bool:
        """Whether samples are token sequences (throughput in tokens/s)."""
        return self.data_type in TEXT_TYPES

    @property
    def run_dir(self) -> str:
        """Where the trained tokenizer, ``metrics.jsonl`` and ``loss.png`` go."""
        return self.train.run_dir

    def with_steps(self, steps: Optional[int]) -> 'JobSpec':
        """This job with ``train.steps`` replaced (``--steps``); unchanged for None."""
        if steps is None:
            return self
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ConfigError(f'--steps must be a positive integer, got {steps}')
        return dataclasses.replace(self, train=dataclasses.replace(self.train, steps=int(steps)))

    def with_vocab(self, vocab: int) -> 'JobSpec':
        """This job once its tokenizer's vocabulary is known: ``options['vocab_size']`` set to
        it (rounded up to 128s) unless the config gives ``model.vocab_size``, which must hold
        it."""
        given = self.model.overrides.get('vocab_size')
        if given is not None:
            if given < vocab:
                raise ConfigError(f"'model.vocab_size' = {given} is smaller than the tokenizer's "
                                  f"vocabulary of {vocab} ('data.tokenizer'); leave "
                                  f"'model.vocab_size' out to take {round_vocab(vocab)}")
            return self
        if 'vocab_size' not in self.options:
            return self
        return dataclasses.replace(self, options=dict(self.options, vocab_size=round_vocab(vocab)))


# ---------------------------------------------------------------------------- parsing
def parse_imports(config: Mapping) -> Tuple[str, ...]:
    """The ``imports`` names, imported (they register models)."""
    names = config.get('imports') or ()
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"'imports' must be a list of module names, got {names!r}")
    try:
        import_modules(names)
    except ValueError as err:
        raise ConfigError(f"'imports': {err}") from None
    return tuple(names)


def parse_model(section: Optional[Mapping]) -> Tuple[ModelSection, Dict[str, Any]]:
    """(the ``model`` section with its preset filled in, the model's resolved options)."""
    model = mapping(section, 'model', 'dict(type=...)', required=True)
    kind = model.get('type')
    if not isinstance(kind, str):
        raise ConfigError(f"'model.type' must be the name of a registered model, got {kind!r}")
    try:
        entry = get_model(kind)
    except ValueError as err:
        raise ConfigError(f"'model.type' = {kind!r}: {err}") from None
    preset = model.get('preset', 'tiny' if 'tiny' in entry.presets else None)
    parsed = ModelSection(kind, preset, {k: v for k, v in model.items() if k not in ('type', 'preset')})
    try:
        _, options = parsed.resolve()
    except ValueError as err:
        raise ConfigError(f"'model': {err}") from None
    return parsed, options


def _fraction(data: Mapping, key: str, hi: float, default: float) -> float:
    return in_range(data.get(key, default), f'data.{key}', 1e-6, hi)


def _seq_len(data: Mapping, options: Mapping) -> int:
    limit = options.get('max_positions', 1 << 20)
    return in_range(data.get('seq_len', min(64, limit)), 'data.seq_len', 2, limit, True)


def parse_data(section: Optional[Mapping], kind: str, options: Dict[str, Any]) -> DataSection:
    """The ``data`` section for a model of type ``kind``; for ``hf`` with a BPE tokenizer and
    no ``model.vocab_size``, sets ``options['vocab_size']`` (module doc)."""
    data = mapping(section, 'data', "dict(type=...)", required=True)
    want = get_model(kind).data
    if want not in DATA_TYPES:
        raise ConfigError(f"model type '{kind}' names no bundled data set to train on "
                          f"(registered with data={want!r}; one of {list(DATA_TYPES)} is needed)")
    if want == 'shakespeare' and data.get('type') == 'hf':
        return _parse_hf(data, options)
    if data.get('type') != want:
        also = " (or 'hf', your own text)" if want == 'shakespeare' else ''
        raise ConfigError(f"model type '{kind}' trains on data type '{want}'{also}, "
                          f"got 'data.type' = {data.get('type')!r}")
    check_keys(data, DATA_KEYS[want], 'data.')
    if want == 'digits':
        for key, need in DIGITS_SHAPE.items():
            if options.get(key, need) != need:
                raise ConfigError(f"'model.{key}' = {options[key]!r} must be {need} for data type "
                                  f"'digits' (8x8 one-channel images of 10 classes)")
        return DataSection('digits', test_fraction=_fraction(data, 'test_fraction', 0.9, 0.2))
    vocab = options.get('vocab_size', 256)
    if vocab < 256:
        raise ConfigError(f"'model.vocab_size' = {vocab} must be at least 256, the byte "
                          f"tokenizer's vocabulary of data type 'shakespeare'")
    plays = data.get('plays')
    if plays is not None and (isinstance(plays, str)
                              or not all(isinstance(p, str) for p in plays)):
        raise ConfigError(f"'data.plays' must be a list of play names, got {plays!r}")
    return DataSection('shakespeare', seq_len=_seq_len(data, options),
                       val_fraction=_fraction(data, 'val_fraction', 0.5, 0.05),
                       plays=None if plays is None else tuple(plays))


def _parse_hf(data: Mapping, options: Dict[str, Any]) -> DataSection:
    check_keys(data, DATA_KEYS['hf'], 'data.')
    for key in ('split', 'text_column'):
        string(data.get(key, 'train' if key == 'split' else 'text'), f'data.{key}')
    tok = data.get('tokenizer')
    if not isinstance(tok, Mapping) or tok.get('type') not in TOKENIZER_KEYS:
        raise ConfigError(f"'data.tokenizer' must be dict(type='bpe', vocab_size=V) or "
                          f"dict(type='file', path='tokenizer.json'), got {tok!r}")
    check_keys(tok, TOKENIZER_KEYS[tok['type']], 'data.tokenizer.')
    if tok['type'] == 'bpe':
        tokenizer = TokenizerSection('bpe', vocab_size=in_range(
            tok.get('vocab_size', 4096), 'data.tokenizer.vocab_size', 260, 1 << 20, True))
    else:
        tokenizer = TokenizerSection('file', path=string(tok.get('path'), 'data.tokenizer.path',
                                                         'the path of a tokenizers file'))
    path = data.get('path')
    if not isinstance(path, str):
        raise ConfigError(f"'data.path' must be a builder name or a directory saved by "
                          f"Dataset.save_to_disk, got {path!r}")
    files = data.get('data_files')
    return DataSection('hf', seq_len=_seq_len(data, options),
                       val_fraction=_fraction(data, 'val_fraction', 0.5, 0.05), path=path,
                       data_files=tuple(files) if isinstance(files, list) else files,
                       split=data.get('split', 'train'),
                       text_column=data.get('text_column', 'text'), tokenizer=tokenizer,
                       cache_dir=data.get('cache_dir'))


def parse_train(config: Mapping) -> TrainSection:
    train = mapping(config.get('train'), 'train', 'dict(global_batch_size=16)')
    check_keys(train, TRAIN_KEYS, 'train.')

    def number(key, lo, hi, default=None):
        return in_range(train.get(key, default), f'train.{key}', lo, hi, True)
    run_dir = train.get('run_dir')
    if run_dir is not None and not isinstance(run_dir, str):
        raise ConfigError(f"'train.run_dir' must be a directory name, got {run_dir!r}")
    ckpt = config.get('checkpoint')
    if run_dir is None and isinstance(ckpt, Mapping) and isinstance(ckpt.get('path'), str):
        run_dir = os.path.dirname(ckpt['path'])
    return TrainSection(global_batch_size=number('global_batch_size', 1, 1 << 30, 16),
                        steps=number('steps', 1, 1 << 40), epochs=number('epochs', 1, 1 << 20, 1),
                        log_every=number('log_every', 1, 1 << 30, 10),
                        eval_batches=number('eval_batches', 1, 1 << 30),
                        shuffle_seed=number('shuffle_seed', 0, 1 << 62, 0),
                        run_dir=run_dir or 'runs')


def parse_optimizer(section: Optional[Mapping]) -> OptimizerSection:
    opt = mapping(section, 'optimizer', "dict(type='adamw', lr=1e-3)")
    kind = typed(opt, 'optimizer', OPTIMIZERS, 'adamw')
    opt.pop('type', None)
    lr = in_range(opt.pop('lr', 1e-3), 'optimizer.lr', 0.0, 10.0)
    for key in ('weight_decay', 'eps', 'momentum'):
        in_range(opt.get(key), f'optimizer.{key}', 0.0, 1.0)
    if 'betas' in opt:
        betas = opt['betas']
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, numbers.Real) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"'optimizer.betas' must be two numbers in [0, 1), got {betas!r}")
        opt['betas'] = tuple(betas)
    return OptimizerSection(kind, lr, opt)


def parse_checkpoint(section: Optional[Mapping]) -> Optional[CheckpointSection]:
    ckpt = mapping(section, 'checkpoint', "dict(path='runs/ckpt')")
    if not ckpt:
        return None
    check_keys(ckpt, ('path', 'interval', 'async_save'), 'checkpoint.')
    async_save = ckpt.get('async_save', False)
    if not isinstance(async_save, bool):
        raise ConfigError(f"'checkpoint.async_save' must be True or False, got {async_save!r}")
    path = ckpt.get('path')
    if not isinstance(path, str) or not path or '{' in path:
        raise ConfigError(f"'checkpoint.path' must be a directory name such as 'runs/ckpt' "
                          f"(each save replaces it atomically), got {path!r}")
    interval = in_range(ckpt.get('interval', 100), 'checkpoint.interval', 1, 1 << 40, True)
    return CheckpointSection(path, interval, async_save)


def parse_log(section: Optional[Mapping]) -> LogSection:
    """``log``; whether tensorboard is installed is checked where the job is prepared."""
    log = mapping(section, 'log', "dict(tensorboard='runs/tb')")
    check_keys(log, ('tensorboard',), 'log.')
    if 'tensorboard' in log and not isinstance(log['tensorboard'], str):
        raise ConfigError(f"'log.tensorboard' must be a directory, got {log['tensorboard']!r}")
    return LogSection(log.get('tensorboard'))


def parse_scheduler(section: Optional[Mapping]) -> SchedulerSection:
    sched = mapping(section, 'lr_scheduler', "dict(type='cosine', warmup_steps=20)")
    kind = typed(sched, 'lr_scheduler', SCHEDULERS, 'constant')
    warmup = in_range(sched.get('warmup_steps', 0), 'lr_scheduler.warmup_steps', 0, 1 << 40, True)
    floor = (in_range(sched.get('min_lr_ratio', 0.1), 'lr_scheduler.min_lr_ratio', 0.0, 1.0)
             if kind == 'cosine' else 1.0)
    return SchedulerSection(kind, warmup, floor)


def parse_job(config: Mapping) -> JobSpec:
    """Validate the job sections of a (plain) config: see the module doc."""
    imports = parse_imports(config)
    model, options = parse_model(config.get('model'))
    data = parse_data(config.get('data'), model.type, options)
    spec = JobSpec(model=model, options=options, data=data, train=parse_train(config),
                   optimizer=parse_optimizer(config.get('optimizer')),
                   lr_scheduler=parse_scheduler(config.get('lr_scheduler')),
                   checkpoint=parse_checkpoint(config.get('checkpoint')),
                   log=parse_log(config.get('log')), imports=imports)
    if data.tokenizer is not None and data.tokenizer.type == 'bpe':
        spec = spec.with_vocab(data.tokenizer.vocab_size)
    return spec

