"""AMP training: the step helper for your own loop, a trainer with telemetry, and the run's history.

- :mod:`~mpnb.training.amp_step`: :class:`AmpStep`, the torch.amp recipe in three calls, recorded.
- :mod:`~mpnb.training.trainer`: :class:`Trainer`, fit / save / load, safe interrupts.
- :mod:`~mpnb.training.telemetry`: the recorder and the :class:`~mpnb.training.telemetry.Sink` protocol.
- :mod:`~mpnb.training.history`: :class:`History`, every column per step.
- :mod:`~mpnb.training.control`, :mod:`~mpnb.training.capture`, :mod:`~mpnb.training.interrupts`:
  stop / pause / live switches, fits held by ``%%compare``, Ctrl-C between steps.
- :mod:`~mpnb.training.step_precision`: a mode on a device, validated once for a run.
"""

from mpnb.training.amp_step import AmpStep
from mpnb.training.history import History
from mpnb.training.step_precision import TrainingPrecision
from mpnb.training.trainer import FitInterrupted, Trainer

__all__ = ["AmpStep", "Trainer", "FitInterrupted", "History", "TrainingPrecision"]
