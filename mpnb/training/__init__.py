"""AMP training: the step helper for your own loop, and a trainer with telemetry and a dashboard."""

from mpnb.training.amp_step import AmpStep
from mpnb.training.precision import TrainingPrecision
from mpnb.training.trainer import FitInterrupted, Trainer

__all__ = ["AmpStep", "Trainer", "FitInterrupted", "TrainingPrecision"]
