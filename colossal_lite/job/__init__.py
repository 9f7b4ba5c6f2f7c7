"""What ``colossal-lite train`` runs, in three modules: the spec (the config's job sections,
parsed once: ``colossal_lite/config/job.py``, ``settings.job``), ``build.py`` (the model,
loss, data, optimizer and scheduler for the current context) and ``checks.py`` (the job
against a layout, with a meta build; the paths; the data prepared once)."""
from ..config.job import JobSpec, parse_job
from .build import (build_criterion, build_data, build_model, build_optimizer, build_scheduler,
                    describe_model, resolve_model_partition, resolve_vocab)
from .checks import check_data, check_layout, check_paths, check_rule, prepare_data

__all__ = ['JobSpec', 'parse_job', 'build_model', 'build_criterion', 'build_data',
           'build_optimizer', 'build_scheduler', 'describe_model', 'resolve_model_partition',
           'resolve_vocab',
           'check_layout', 'check_rule', 'check_paths', 'check_data', 'prepare_data']
