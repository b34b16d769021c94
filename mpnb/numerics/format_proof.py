"""The proof of a what-if's advice: the recommended configuration trained beside bf16.

:func:`prove` builds two runs with the ``make_run`` a comparison takes (``make_run(mode)``
returns ``(trainer, data)`` or ``(trainer, data, metric)``; see :mod:`mpnb.analysis.runs`):
bf16, and the format's mode keeping the layers :meth:`~mpnb.numerics.whatif.WhatIf.recommend`
names. A mode with a ``keep`` option (fp8, and any mode that takes one) gets them there; fp16
and bf16 run each kept layer in fp32 (``Trainer.keep_in_fp32``). Both train the same number of
steps from the same fresh run, and the report is the loss gap step by step: its mean over the
second half of the run, its spread (the standard deviation of the per-step differences) and
standard error, whether it stands out of that noise (more than two standard errors), beside
bf16's own loss.

Example:
    >>> configuration("fp8", ["lm_head"])
    (Mode('fp8', keep=('lm_head',)), [])
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mpnb.errors import MpnbError, check_count
from mpnb.numerics.layer_matmuls import shown_layer
from mpnb.precision.modes.base import Mode
from mpnb.precision.modes.registry import format_mode, parse_mode
from mpnb.training.batches import epochs_holding
from mpnb.training.own_run import shared_part

__all__ = ["Proof"]

BASELINE = "bf16"
#: A gap further than this many standard errors from zero stands out of the step-to-step noise
#: (the per-step differences are paired: both runs take the same batches in the same order).
GAP_STANDARD_ERRORS = 2.0


@dataclasses.dataclass
class Proof:
    """The recommended configuration of a format trained beside bf16.

    Attributes:
        format: the format proved.
        mode: the mode the configuration ran, as its label (``"fp8:tensorwise"``).
        keep: the layers kept in higher precision.
        losses: its loss at each step; ``bf16_losses``: bf16's.
        gap: the mean of (its loss - bf16's) over the second half of the steps.
        spread: the standard deviation of those per-step differences (NaN with fewer than
            two: no noise to measure).
        standard_error: the gap's (the spread over the square root of their count).
        shows_gap: whether the gap is more than two standard errors from zero (False where
            the noise is unknown: too few steps to tell).

    Example:
        >>> proof = Proof("fp8", "fp8:tensorwise", ["4"], [2.0, 1.5, 1.2, 1.0], [2.0, 1.4, 1.1, 1.0])
        >>> round(proof.gap, 3), round(proof.spread, 3), round(proof.standard_error, 3), proof.shows_gap
        (0.05, 0.071, 0.05, False)
        >>> print(proof)
        fp8 (fp8:tensorwise, keeping 4) beside bf16 over 4 steps: loss gap +0.05 over the last 2 steps (spread 0.0707, standard error 0.05): 1.0 standard errors, no gap beyond the noise; +4.8% of bf16's mean loss there (1.05)
    """

    format: str
    mode: str
    keep: list[str]
    losses: list[float]
    bf16_losses: list[float]
    #: the steps each run was asked for (None: as many as it trained)
    steps_asked: int | None = None

    @property
    def _window(self) -> tuple[list[float], list[float]]:
        steps = min(len(self.losses), len(self.bf16_losses))
        start = steps // 2
        return self.losses[start:steps], self.bf16_losses[start:steps]

    @property
    def _differences(self) -> list[float]:
        """The per-step differences (this configuration minus bf16) the gap averages."""
        ours, theirs = self._window
        return [a - b for a, b in zip(ours, theirs)]

    @property
    def _finite(self) -> bool:
        """Neither run's loss went inf or NaN in the steps compared."""
        return all(map(math.isfinite, self._differences))

    @property
    def gap(self) -> float:
        """Mean per-step loss difference (this configuration minus bf16), second half of the run."""
        differences = self._differences
        return statistics.fmean(differences) if differences else math.nan

    @property
    def spread(self) -> float:
        """Standard deviation of the per-step differences the gap averages (NaN for fewer than
        two, or where a run's loss went inf or NaN)."""
        differences = self._differences
        if len(differences) < 2 or not self._finite:
            return math.nan
        return statistics.stdev(differences)

    @property
    def standard_error(self) -> float:
        """The gap's standard error: the spread over the square root of the steps it averages."""
        steps = len(self._window[0])
        return self.spread / math.sqrt(steps) if steps else math.nan

    @property
    def shows_gap(self) -> bool:
        """Whether the gap stands out of the step-to-step noise: more than
        :data:`GAP_STANDARD_ERRORS` standard errors from zero (a run gone inf or NaN does;
        with fewer than two steps compared the noise is unknown: False)."""
        if not self._finite or not self._differences:
            return True
        if len(self._differences) < 2:
            return False
        return abs(self.gap) > GAP_STANDARD_ERRORS * self.standard_error

    def _verdict(self) -> str:
        if not self._finite or not self._differences:
            return "a run's loss is not finite"
        if len(self._differences) < 2:
            return (
                "too few steps to tell a gap from the noise (one step compared; prove with "
                "steps=4 or more)"
            )
        if self.standard_error == 0:
            return "a gap" if self.gap else "no gap"
        errors = abs(self.gap) / self.standard_error
        said = "a gap" if self.shows_gap else "no gap beyond the noise"
        return f"{errors:.1f} standard errors, {said}"

    def __str__(self) -> str:
        ours, theirs = self._window
        reference = statistics.fmean(theirs) if theirs else math.nan
        kept = ", ".join(map(shown_layer, self.keep)) if self.keep else "no layer of the advice"
        share = f"{self.gap / abs(reference):+.1%}" if reference else "n/a"
        trained = min(len(self.losses), len(self.bf16_losses))
        short = (
            f" (of the {self.steps_asked} asked: the data ended)"
            if self.steps_asked is not None and trained < self.steps_asked
            else ""
        )
        return (
            f"{self.format} ({self.mode}, keeping {kept}) beside {BASELINE} over {trained} "
            f"steps{short}: loss gap {self.gap:+.3g} over the last {len(ours)} steps "
            f"({_noise(self.spread, self.standard_error)}): {self._verdict()}; "
            f"{share} of {BASELINE}'s mean loss there ({reference:.3g})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _noise(spread: float, standard_error: float) -> str:
    """The spread and the standard error as the proof's line says them ("n/a" where unknown).

    >>> _noise(0.0707, 0.05), _noise(math.nan, math.nan)
    ('spread 0.0707, standard error 0.05', 'spread n/a')
    """
    if math.isnan(spread):
        return "spread n/a"
    return f"spread {spread:.3g}, standard error {standard_error:.2g}"


def configuration(format: str, keep: Sequence[str]) -> tuple[Mode, list[str]]:
    """The mode that trains ``format`` keeping ``keep``, and the layers left for
    ``Trainer.keep_in_fp32`` (those a mode without a ``keep`` option cannot take).

    Raises:
        InvalidChoiceError: an unknown format.

    Example:
        >>> configuration("fp8_rowwise", ["head"])
        (Mode('fp8', recipe='rowwise', keep=('head',)), [])
        >>> configuration("fp16", ["head"])
        (Mode('fp16'), ['head'])
    """
    mode = format_mode(format)  # a mode the machine cannot run refuses as the run is built
    if keep and "keep" in {field.name for field in mode.option_fields()}:
        if "" in keep:  # the what-if's name of a model that is one layer
            raise MpnbError(
                f"the layer to keep is the model itself (a model that is one layer): {format} "
                "would train none of it; train it in bf16 or fp32 instead"
            )
        return parse_mode(mode, keep=list(keep)), []
    return mode, list(keep)


def prove(
    keep: Sequence[str], make_run: Callable[[Any], Sequence[Any]], format: str, steps: int = 20
) -> Proof:
    """Train ``format`` keeping the layers ``keep`` (a what-if's advice) and bf16 for ``steps``
    steps each.

    Args:
        keep: the layers to keep in higher precision (:meth:`~mpnb.numerics.whatif.WhatIf.recommend`;
            one name, or None for none).
        make_run: ``make_run(mode) -> (trainer, data)`` or ``(trainer, data, metric)``, a fresh
            run each call, as :func:`mpnb.compare` takes it. It is called with the recommended
            mode first (a :class:`~mpnb.precision.modes.base.Mode` carrying its ``keep`` option
            where it has one: hand it to ``Trainer(mode=...)``), then with ``"bf16"``.
        format: a format the what-if measured.
        steps: optimizer steps of each run.

    Raises:
        InvalidChoiceError: an unknown format.
        MpnbError: the mode's own refusal where this machine cannot run it (nvfp4 off
            Blackwell GPUs), raised by ``make_run``, or of a model it would convert no layer of
            (before a step); ``keep`` holds something other than
            names; a run trained no step (its data was empty).
        TypeError: ``make_run`` returned something else than a trainer and its data.
        ValueError: ``steps`` is not a whole number >= 1.

    Example:
        >>> Proof("bf16", "bf16", [], [1.0], [1.0]).gap
        0.0
    """
    keep = _layer_names(keep)
    steps = check_count("steps", steps)
    mode, in_fp32 = configuration(format, keep)
    # the format's run first: a mode that refuses the model or the machine says so before
    # bf16's run has cost anything
    first = _built(make_run, mode)
    losses = _losses(first, mode, in_fp32, steps)
    baseline = _losses(_built(make_run, BASELINE, first), BASELINE, [], steps)
    return Proof(format, mode.label, keep, losses, baseline, steps)


def _layer_names(keep: object) -> list[str]:
    """``keep`` as a list of layer names: one name, None for none, or names."""
    if keep is None:
        return []
    names = [keep] if isinstance(keep, str) else keep
    if not isinstance(names, Iterable) or isinstance(names, (bytes, dict)):
        raise MpnbError(f"keep takes layer names (what recommend returns), got {keep!r}")
    names = list(names)
    odd = [name for name in names if not isinstance(name, str)]
    if odd:
        raise MpnbError(f"keep takes layer names (what recommend returns), got {odd[0]!r}")
    return names


def _built(
    make_run: Callable[[Any], Sequence[Any]], mode: Any, other: Sequence[Any] | None = None
) -> Sequence[Any]:
    """``make_run(mode)``, checked before a step: a trainer and its data, training in ``mode``
    (its ``keep`` included), with a model and data of its own (not those of ``other``, the run
    before: :func:`~mpnb.training.own_run.shared_part`)."""
    run = make_run(mode)
    if not isinstance(run, (tuple, list)) or len(run) not in (2, 3) or not hasattr(run[0], "fit"):
        raise TypeError(
            f"make_run({mode!r}) returned {type(run).__name__}; it must return (trainer, data) "
            "or (trainer, data, metric) with an mpnb.Trainer, as compare's make_run does"
        )
    trainer = run[0]
    shared = None if other is None else shared_part(trainer, run[1], *other)
    if shared is not None:
        raise MpnbError(
            f"the runs of {other[0].mode.label} and {BASELINE} share {shared}: "
            + (
                "the bf16 run would train on the batches the other left; give each run its own "
                "(a list or a DataLoader, or a generator made in make_run)"
                if shared == "one data iterator"
                else "build a fresh model, optimizer and Trainer in each call of make_run"
            )
        )
    wanted = parse_mode(mode)
    if trainer.mode != wanted:
        raise MpnbError(
            f"the run built for mode {_described(wanted)} trains in {_described(trainer.mode)}: "
            "build its Trainer with mode= the mode make_run(mode) receives (it carries the "
            "layers to keep)"
        )
    return run


def _described(mode: Mode) -> str:
    """A mode's label, with the layers it keeps.

    >>> _described(parse_mode("fp8", keep=["head", "4"])), _described(parse_mode("bf16"))
    ('fp8 (keep head, 4)', 'bf16')
    """
    keep = getattr(mode, "keep", ())
    return f"{mode.label} (keep {', '.join(keep)})" if keep else mode.label


def _losses(run: Sequence[Any], mode: Any, in_fp32: list[str], steps: int) -> list[float]:
    trainer, data = run[0], run[1]
    if trainer.mode.converts_layers:  # said before a step, not from inside the fit
        trainer.mode.check_model(trainer.model, trainer.device)
    for layer in in_fp32:
        trainer.keep_in_fp32(layer)
    # a short dataset cycled, as compare cycles it
    epochs = epochs_holding(data, steps * trainer.amp.accumulate)
    history = trainer.fit(data, epochs=epochs, max_steps=steps)
    losses = [float(loss) for loss in history.loss]
    if not losses:
        raise MpnbError(f"the {mode} run trained no step: the data make_run returned gave no batch")
    return losses
