"""A training job described by a config's ``model``, ``data``, ``train``, ``optimizer`` and
``lr_scheduler`` sections: validated into a :class:`JobSpec`, then built into the model,
loss, data loaders, optimizer and scheduler that ``colossal_lite.initialize`` takes.

Sections (every key optional except ``model.type`` and ``data.type``)::

    model = dict(type='gpt' | 'vit', preset='tiny', **preset_overrides)
    data = dict(type='shakespeare', seq_len=64, val_fraction=0.05, plays=None)
         | dict(type='digits', test_fraction=0.2)
    train = dict(global_batch_size=16, steps=None, epochs=1, log_every=10,
                 eval_batches=None, shuffle_seed=0)
    optimizer = dict(type='adamw' | 'adam' | 'sgd', lr=1e-3, weight_decay=0.0, ...)
    lr_scheduler = dict(type='cosine' | 'constant', warmup_steps=0, min_lr_ratio=0.1)
    checkpoint = dict(path='runs/model_{step}.pt', interval=100)  # full state dict, rank 0
    log = dict(tensorboard='runs/tb')                             # needs the tensorboard package

Every bad value raises :class:`~colossal_lite.config.ConfigError` naming the key and the value.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch

from .config import ConfigError, _check_keys

MODEL_TYPES = ('gpt', 'vit')
DATA_FOR_MODEL = {'gpt': 'shakespeare', 'vit': 'digits'}
_DATA_KEYS = {'shakespeare': {'type', 'seq_len', 'val_fraction', 'plays'},
              'digits': {'type', 'test_fraction'}}
_TRAIN_KEYS = {'global_batch_size', 'steps', 'epochs', 'log_every', 'eval_batches', 'shuffle_seed'}
_OPTIMIZERS = {'adamw': {'lr', 'weight_decay', 'betas', 'eps'},
               'adam': {'lr', 'weight_decay', 'betas', 'eps'},
               'sgd': {'lr', 'weight_decay', 'momentum', 'nesterov'}}
_SCHEDULERS = {'cosine': {'type', 'warmup_steps', 'min_lr_ratio'}, 'constant': {'type', 'warmup_steps'}}


@dataclass
class JobSpec:
    """The validated job sections (plain dicts with defaults filled in)."""

    model: Dict[str, Any]
    data: Dict[str, Any]
    train: Dict[str, Any]
    optimizer: Dict[str, Any]
    lr_scheduler: Dict[str, Any] = field(default_factory=lambda: {'type': 'constant'})
    checkpoint: Dict[str, Any] = field(default_factory=dict)
    log: Dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.model['type']


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


def _parse_model(config: Mapping) -> Dict[str, Any]:
    model = _section(config, 'model', required=True)
    if model.get('type') not in MODEL_TYPES:
        raise ConfigError(f"'model.type' must be one of {list(MODEL_TYPES)}, got {model.get('type')!r}")
    model.setdefault('preset', 'tiny')
    try:
        model['_resolved'] = build_model(model, dry_run=True)
    except ValueError as exc:
        raise ConfigError(f"'model': {exc}") from None
    return model


def _parse_data(config: Mapping, model: Mapping) -> Dict[str, Any]:
    data = _section(config, 'data', required=True)
    model_type = model['type']
    want = DATA_FOR_MODEL[model_type]
    if data.get('type') != want:
        raise ConfigError(f"model type '{model_type}' trains on data type '{want}', "
                          f"got 'data.type' = {data.get('type')!r}")
    _check_keys(data, _DATA_KEYS[want], 'data.')
    if want == 'shakespeare':
        limit = model['_resolved']['max_positions']
        data['seq_len'] = _number(data, 'seq_len', 'data', 2, limit, True, min(64, limit))
        data['val_fraction'] = _number(data, 'val_fraction', 'data', 1e-6, 0.5, default=0.05)
        if data.get('plays') is not None:
            from .data.text import corpus_files
            try:
                corpus_files(data['plays'])
            except ValueError as err:
                raise ConfigError(f"'data.plays': {err}") from None
    else:
        data['test_fraction'] = _number(data, 'test_fraction', 'data', 1e-6, 0.9, default=0.2)
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
        _check_keys(ckpt, {'path', 'interval'}, 'checkpoint.')
        if not isinstance(ckpt.get('path'), str):
            raise ConfigError(f"'checkpoint.path' must be a file name such as "
                              f"'runs/model_{{step}}.pt', got {ckpt.get('path')!r}")
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
    """Validate the job sections of a (loaded) config; see the module doc for the keys."""
    model = _parse_model(config)
    return JobSpec(model=model, data=_parse_data(config, model), train=_parse_train(config),
                   optimizer=_parse_optimizer(config), lr_scheduler=_parse_scheduler(config),
                   checkpoint=_parse_checkpoint(config), log=_parse_log(config))


# ---------------------------------------------------------------------------- building
def build_model(model: Mapping, dry_run: bool = False):
    """The model_zoo model of ``model.type`` from ``model.preset`` with the other keys as overrides.

    ``dry_run`` only checks the options and returns them (no weights are created).
    """
    from model_zoo import GPT, GPT_PRESETS, VIT_PRESETS, ViT
    from model_zoo.blocks import preset_config
    overrides = {k: v for k, v in model.items() if k not in ('type', 'preset', '_resolved')}
    cls, presets = (GPT, GPT_PRESETS) if model['type'] == 'gpt' else (ViT, VIT_PRESETS)
    cfg = preset_config(presets, model['preset'], overrides, model['type'].upper())
    if model['type'] == 'gpt' and cfg['vocab_size'] < 256:
        raise ValueError(f"GPT vocab_size must be at least the byte tokenizer's 256, "
                         f"got {cfg['vocab_size']}")
    if model['type'] == 'vit' and (cfg['img_size'], cfg['in_chans'], cfg['num_classes']) != (8, 1, 10):
        raise ValueError(f"the digits images need img_size=8, in_chans=1, num_classes=10, got "
                         f"{(cfg['img_size'], cfg['in_chans'], cfg['num_classes'])}")
    return cfg if dry_run else cls(**cfg)


def build_criterion(spec: JobSpec):
    from model_zoo import GPTLMLoss
    import colossal_lite.nn as col_nn
    return GPTLMLoss() if spec.kind == 'gpt' else col_nn.CrossEntropyLoss()


def build_data(spec: JobSpec, device: Optional[torch.device] = None):
    """(train loader, test loader, items per sample) with each DATA rank's slice of each batch."""
    from .data import DataParallelLoader, digits_datasets, text_datasets
    if spec.kind == 'gpt':
        seq_len = spec.data['seq_len']
        train, test = text_datasets(seq_len, spec.data['val_fraction'], spec.data.get('plays'))
        per_sample = seq_len
    else:
        train, test = digits_datasets(spec.data['test_fraction'])
        per_sample = 1
    batch, seed = spec.train['global_batch_size'], spec.train['shuffle_seed']
    return (DataParallelLoader(train, batch, shuffle=True, seed=seed, device=device),
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
