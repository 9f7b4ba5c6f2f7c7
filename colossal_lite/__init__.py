"""colossal_lite: train large Transformers across many devices from a config dict."""
from .config import Config, ConfigError, load_config
from .launch import launch, launch_from_openmpi, launch_from_slurm, launch_from_torch
from .initialize import initialize
from . import trainer
from ._version import __version__

__all__ = ['Config', 'ConfigError', 'load_config', 'launch', 'launch_from_torch',
           'launch_from_slurm', 'launch_from_openmpi', 'initialize', 'trainer', '__version__']
