"""The checkpoints of a ``colossal-lite train`` job: what it saves, when, and where a run
continues from. The worker calls :func:`resume` once after ``initialize`` and adds
:func:`hooks` to the trainer; nothing else of the job knows about checkpoints.

* **Save** (``checkpoint = dict(path=DIR, interval=N, async_save=False)``): every ``N``
  steps and after the last one, ``colossal_lite.checkpoint.save(DIR, engine, lr_scheduler,
  train loader, extra=checkpoint.job.job_extra(config, steps=total))`` -- collective,
  atomic (``DIR`` is replaced by the complete new checkpoint), the model, optimizer, AMP,
  LR scheduler, RNG, step and the loader's position. ``async_save``: the files of an
  interval save are written during the next step, which then completes it.
* **Resume**: ``--resume DIR`` loads ``DIR`` (any layout: DCP reshards; the data position
  carries over in global samples); a worker the elastic agent restarted
  (``TORCHELASTIC_RESTART_COUNT`` > 0) loads the job's own ``checkpoint.path`` when a
  complete checkpoint is there (else ``--resume``, else it starts over). Training then
  runs the steps left: the trainer's step counter starts at the saved step
  (:class:`_StartAt`), so logs, the save interval and ``train.steps`` count as in the
  uninterrupted run.
* **Fault injection for tests**: with ``COLOSSAL_LITE_TEST_KILL='RANK:STEP'`` in the
  environment, global rank ``RANK`` kills itself (SIGKILL) after step ``STEP`` of the first
  attempt only (restart count 0). Used by tests/test_resume.py for ``--max-restarts``.
"""
from __future__ import annotations

import os
import signal
from typing import List, Optional

import colossal_lite.checkpoint as checkpoint

from .checkpoint.files import COMMON, complete_dir, read, resolve
from .checkpoint.job import job_extra
from .context import global_context as gpc
from .trainer import hooks as H

KILL_ENV = 'COLOSSAL_LITE_TEST_KILL'


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group (0: first attempt):
    under ``colossal_lite.launcher`` the count every node agreed on (``COLOSSAL_LITE_ATTEMPT``,
    ``launcher/rendezvous.py``: a node restarted because another failed counts it too),
    else torch's own ``TORCHELASTIC_RESTART_COUNT`` (torchrun)."""
    return int(os.environ.get('COLOSSAL_LITE_ATTEMPT')
               or os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a complete checkpoint (also one a crash during a save's commit
    left at ``path.old-<uuid>``, which ``checkpoint.load`` then reads)."""
    return complete_dir(path) is not None


def resume_dir(spec, resume: Optional[str]) -> Optional[str]:
    """The checkpoint this worker continues from (see the module doc), or None."""
    own = spec.checkpoint.path if spec.checkpoint else None
    if restart_count() > 0 and own and is_complete(own):
        return own
    return resume


def saved_step(path: str) -> int:
    """The global step a complete checkpoint was saved at (read as data; no collective).
    ``checkpoint.UnsafeCheckpointError`` for a ``common.pt`` that would need a Python object
    (code) to be read, a ``ValueError`` naming the file for one that cannot be read at all
    (empty, truncated, not a ``torch.save`` file, no permission)."""
    file = os.path.join(resolve(path), COMMON)
    try:
        common = read(file)
    except (EOFError, RuntimeError, OSError) as err:  # files.read: refused ones raise their own
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else 'it ends early'
        raise ValueError(f'{file}: unreadable ({type(err).__name__}: {reason}): not a complete '
                         f'file written by checkpoint.save (truncated or corrupt?)') from None
    if not isinstance(common, dict) or not isinstance(common.get('global_step'), int):
        raise ValueError(f'{file} is not the common state of a checkpoint (no global step)')
    return common['global_step']


def resume(spec, engine, lr_scheduler, train_loader, resume_from: Optional[str]) -> int:
    """Load the checkpoint this run continues from into the engine, scheduler and loader
    (collective); the step to start at (0 without one)."""
    path = resume_dir(spec, resume_from)
    if path is None:
        return 0
    checkpoint.load(path, engine, lr_scheduler=lr_scheduler, dataloader=train_loader)
    if gpc.get_global_rank() == 0:
        again = f' (restart {restart_count()})' if restart_count() else ''
        print(f'resumed from {path} at step {engine.global_step}{again}', flush=True)
    return engine.global_step


def hooks(settings, spec, start_step: int, total: int, config_path: Optional[str], lr_scheduler,
          train_loader) -> List[H.BaseHook]:
    """The trainer hooks of the job's checkpoints: the start step, the saves (carrying
    ``settings``' config, ``checkpoint.job.job_extra``), the test kill."""
    out: List[H.BaseHook] = [_StartAt(start_step)]
    if spec.checkpoint:
        extra = job_extra(settings, config_path, steps=total)
        out.append(H.SaveCheckpointHook(spec.checkpoint.path, spec.checkpoint.interval,
                                        by_step=True, lr_scheduler=lr_scheduler,
                                        dataloader=train_loader, extra=extra,
                                        async_save=spec.checkpoint.async_save))
    if os.environ.get(KILL_ENV) and restart_count() == 0:
        rank, step = (int(x) for x in os.environ[KILL_ENV].split(':'))
        out.append(_KillAt(rank, step))
    return out


class _StartAt(H.BaseHook):
    """Sets the trainer's step counter to the resumed step before training."""

    uses_train_output = False
    priority = H.METRIC_PRIORITY - 1

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def before_train(self, trainer):
        trainer.cur_step = self.step


class _KillAt(H.BaseHook):
    """Test fault: global rank ``rank`` ends itself with SIGKILL after step ``step``."""

    uses_train_output = False
    priority = H.OUTPUT_PRIORITY + 2

    def __init__(self, rank: int, step: int):
        super().__init__()
        self.rank, self.step = rank, step

    def after_train_iter(self, trainer, output, label, loss):
        if trainer.cur_step == self.step and gpc.get_global_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
