"""The ground floor: a user's config (a dict or a ``.py`` file) parsed once into typed,
frozen sections. Imports nothing above it (``models.py``'s registry is beside it).

* ``loader.py``    -- :class:`Config`, :func:`load_config`, :func:`snapshot` (the one reader
  of the user's dict);
* ``settings.py``  -- :class:`Settings` (``cfg.settings``), the built-in sections;
* ``registry.py``  -- :func:`register_section` / :func:`register_check`: how a feature adds
  a section;
* ``checks.py``    -- :class:`ConfigError` and the one set of checking helpers;
* one module per section: ``layout.py`` (``parallel``), ``pipeline.py``, ``zero.py``,
  ``sections.py`` (``fp16``, the engine's step policy, ``seed``/``timeout``/``backend``),
  ``job.py`` (``model``, ``data``, ``train``, ``optimizer``, ``lr_scheduler``,
  ``checkpoint``, ``log``);
* the tables the sections check against: ``modes.py`` (:class:`ParallelMode`),
  ``families.py`` (one row per tensor mode), ``schedules.py`` (one row per pipeline
  schedule).
"""
from .checks import ConfigError
from .layout import AutoSettings, ParallelLayout, parse_auto, parse_parallel
from .loader import Config, load_config, parse_settings, read_config_file, snapshot, validate_config
from .modes import ParallelMode
from .pipeline import PipelineSettings, parse_pipeline
from .registry import Section, register_check, register_section
from .sections import FP16_MODES, AmpSettings, EngineSettings, RunSettings
from .settings import Settings
from .zero import ZeroSettings, parse_zero

__all__ = ['ConfigError', 'Config', 'load_config', 'parse_settings', 'read_config_file',
           'snapshot', 'validate_config', 'Settings', 'Section', 'register_section',
           'register_check', 'ParallelLayout', 'AutoSettings', 'parse_parallel', 'parse_auto',
           'ParallelMode', 'PipelineSettings', 'parse_pipeline', 'FP16_MODES', 'AmpSettings',
           'EngineSettings', 'RunSettings', 'ZeroSettings', 'parse_zero']
