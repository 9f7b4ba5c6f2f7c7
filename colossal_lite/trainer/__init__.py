"""Trainer and hooks."""
from . import hooks
from .hooks import (AccuracyHook, BaseHook, LogMetricByEpochHook, LogMetricByStepHook, LossHook,
                    LRSchedulerHook, MemoryHook, MoEStatsHook, SaveCheckpointHook, TensorBoardHook,
                    ThroughputHook)
from .trainer import Trainer

__all__ = ['AccuracyHook', 'BaseHook', 'LogMetricByEpochHook', 'LogMetricByStepHook', 'LossHook',
           'LRSchedulerHook', 'MemoryHook', 'MoEStatsHook', 'SaveCheckpointHook', 'TensorBoardHook',
           'ThroughputHook', 'Trainer', 'hooks']
