"""The base of every precision mode: a class whose defaults do nothing.

A mode is one class in one module of :mod:`mpnb.precision.modes`, registered once by name
(:func:`~mpnb.precision.modes.registry.register`). The class owns everything that differs
between modes: whether it runs on a device and why not, the autocast dtype, whether the loss
needs scaling, the fp32-math setting, what it does to a model and how that is undone, FSDP's
``MixedPrecisionPolicy``, how a framework's loop is asked for it and read back, its status and
compare words, and the options it takes. Everything else in mpnb asks the mode object and never
branches on a mode's name, as Lightning's precision plugins and ``torch.autocast(enabled=False)``
do it: the base class is the "nothing special" mode, and each mode overrides what differs.

A mode object is a frozen dataclass: its fields are its options (fp8's ``recipe`` and ``keep``).
It equals another mode of the same class and options, and the string of its :attr:`~Mode.label`
when that says all its options (``"fp8:rowwise"``, but no string for one with ``keep``).

Example:
    >>> from mpnb.precision.modes import parse_mode
    >>> bf16 = parse_mode("bfloat16")
    >>> bf16, bf16.autocast_dtype, bf16.needs_scaler, bf16 == "bf16"
    (Mode('bf16'), torch.bfloat16, False, True)
    >>> parse_mode("fp16").needs_scaler
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from mpnb.errors import MpnbError
from mpnb.precision.autocast_settings import check_autocast_dtype
from mpnb.precision.backends import Backend, backend_for
from mpnb.precision.modes.matmul_format import MatmulFormat
from mpnb.precision.names import Fp32Math

__all__: list[str] = []  # the package lists Mode

#: compare's verdict for a mode that changes nothing on this hardware (tf32 where fp32 math stays exact).
NO_EFFECT = "no effect on this hardware"
#: compare's verdict for a mode this hardware emulates: its step time measures the emulation.
EMULATED = "emulated: numerics only, no speed-up"


class Fp32Wishes(Protocol):
    """What a mode sets of the session: its fp32-math wish (the session, :mod:`mpnb.precision.policy`)."""

    def want_fp32_math(self, backend: Backend | None, level: Fp32Math | None) -> None: ...


def option(default: Any, help: str, *, many: bool = False, choices: tuple[str, ...] = ()) -> Any:
    """A mode's option: a dataclass field whose ``help`` the magics and the CLI show (``many``:
    a list of names, ``--keep a b``; ``choices``: the values it takes)."""
    return dataclasses.field(
        default=default, metadata={"help": help, "many": many, "choices": choices}
    )


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Mode:
    """A precision mode. The defaults are those of a mode that changes nothing: autocast off,
    no loss scaling, the fp32-math flags and the model left as they are.

    Class attributes (what a subclass sets):
        name: the mode's name (``"bf16"``); aliases: other names it answers to.
        summary: one line that says what it does.
        autocast_dtype: the dtype autocast runs in, or None for autocast off.
        fp32_math: the fp32-math level it sets, or None to leave the flags to the session.
        needs_scaler: whether the loss needs scaling (a ``GradScaler``): fp16's narrow range.
        converts_layers: whether it swaps a model's layers (:meth:`model_scope`).
        reference: compare measures every mode's speedup against this one (fp32).
        framework_hint: what to do instead where a framework has no setting for this mode
            (a clause: "ask for bf16 and ...").
        matmul_formats: the number formats its matmuls multiply in, for the what-if to measure
            (:mod:`~mpnb.precision.modes.matmul_format`; fp8: ``fp8`` and ``fp8_rowwise``).
        observed_as: what mpnb's reading of a framework's forward pass (autocast and weights)
            sees when this mode's layers run (fp8's float8 layers under bf16 autocast: ``"bf16"``).

    Example (a mode of one's own, for a test: bf16 autocast under another name):
        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True, eq=False, repr=False)
        ... class Brain16(Mode):
        ...     name = "brain16"
        ...     summary = "bf16 autocast under another name"
        ...     autocast_dtype = torch.bfloat16
        >>> Brain16().describe(torch.device("cpu")), Brain16().lightning_precision
        ('brain16 on cpu', 'bf16-mixed')
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    summary: ClassVar[str] = ""
    autocast_dtype: ClassVar[torch.dtype | None] = None
    fp32_math: ClassVar[Fp32Math | None] = None
    needs_scaler: ClassVar[bool] = False
    converts_layers: ClassVar[bool] = False
    reference: ClassVar[bool] = False
    framework_hint: ClassVar[str] = ""
    observed_as: ClassVar[tuple[str, ...]] = ()
    matmul_formats: ClassVar[tuple[MatmulFormat, ...]] = ()

    # -- identity ------------------------------------------------------------------------

    @classmethod
    def option_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The options this mode takes (its dataclass fields), in order."""
        return dataclasses.fields(cls)

    def options(self) -> dict[str, Any]:
        """The options set to something other than their default."""
        return {
            field.name: getattr(self, field.name)
            for field in self.option_fields()
            if getattr(self, field.name) != field.default
        }

    @functools.cached_property  # read at every step's record: made once (the mode is frozen)
    def label(self) -> str:
        """The name, with the first option after a colon where it is not the default:
        ``"fp8"``, ``"fp8:rowwise"`` (what compare's rows and :func:`parse_mode` take)."""
        said = self.label_option()
        if said is not None and getattr(self, said.name) != said.default:
            return f"{self.name}:{getattr(self, said.name)}"
        return self.name

    @classmethod
    def label_option(cls) -> dataclasses.Field | None:
        """The option a label says: the first, unless it is a list of names (``keep``)."""
        fields = cls.option_fields()
        if fields and not fields[0].metadata.get("many", False):
            return fields[0]
        return None

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        options = "".join(f", {key}={value!r}" for key, value in self.options().items())
        return f"Mode({self.name!r}{options})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):  # its label, when the label says every option it has
            said = {field.name for field in [self.label_option()] if field is not None}
            return other == self.label and set(self.options()) <= said
        if type(other) is not type(self):
            return NotImplemented
        return self.options() == other.options()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash(self.label)

    @property
    def changes_nothing(self) -> bool:
        """Whether the mode leaves torch as it is: no autocast, no fp32-math level, no layers
        converted (mode off)."""
        return self.autocast_dtype is None and self.fp32_math is None and not self.converts_layers

    @property
    def runs_without_autocast(self) -> bool:
        """Whether the mode chooses a precision and runs it with autocast off (fp32, tf32): a
        block that asks for the session's autocast, ``with mpnb.autocast():``, runs with it off
        too. Mode off chooses nothing.

        >>> from mpnb.precision.modes import parse_mode
        >>> {name: parse_mode(name).runs_without_autocast for name in ("off", "fp32", "bf16")}
        {'off': False, 'fp32': True, 'bf16': False}
        """
        return self.autocast_dtype is None and not self.changes_nothing

    # -- where it runs -------------------------------------------------------------------

    def check(self, device: torch.device) -> None:
        """Refuse a device this mode does not run on, with the sentence a user reads.

        Raises:
            MpnbError: the device cannot run the mode (names what can).
        """
        if self.autocast_dtype is not None:
            check_autocast_dtype(backend_for(device), device, self.autocast_dtype)

    def unavailable(self, device: torch.device) -> str:
        """Why this mode does not run on ``device``; empty where it does."""
        try:
            self.check(device)
        except MpnbError as error:
            return str(error)
        return ""

    def support(self, device: torch.device) -> str:
        """How the mode runs on ``device``, in words (a device report's column for the modes that
        convert layers): ``"yes"``, or ``"no: "`` and the reason."""
        refusal = self.unavailable(device)
        return f"no: {refusal}" if refusal else "yes"

    # -- the session ---------------------------------------------------------------------

    def apply_fp32_math(self, session: Fp32Wishes, backend: Backend) -> None:
        """Make the mode's fp32-math level the session's wish; a mode without one leaves the
        session's wish (``%tf32``) as it is."""
        if self.fp32_math is not None:
            session.want_fp32_math(backend, self.fp32_math)

    def with_fp32_math(self, reduced: bool) -> Mode | None:
        """The mode to be in when the fp32-math switch (``%tf32``) is set while this mode runs,
        for a mode that owns the switch (fp32 and tf32: the other one, or itself); None: the
        switch is separate from the mode."""
        return None

    def notes(self, backend: Backend) -> list[str]:
        """What a user should know about this mode on ``backend`` (the status's warnings)."""
        return []

    def status_rows(self, device: torch.device) -> list[tuple[str, str]]:
        """Extra (label, value) rows of ``%amp status`` for this mode (fp8: its recipe, where it runs)."""
        return []

    # -- a model and a step --------------------------------------------------------------

    def check_model(self, model: nn.Module, device: torch.device) -> None:
        """Refuse a model :meth:`model_scope` cannot change (nothing is changed).

        Raises:
            MpnbError: the mode converts no layer of ``model``, or it converts none at all.
        """
        if not self.converts_layers:
            raise MpnbError(
                f"mode {self.label} changes no model: a model goes with a mode that converts "
                "layers (see mpnb.precision.modes.mode_names(converts_layers=True))"
            )

    def casts_layer(self, module: nn.Module) -> bool:
        """Whether the mode's matmul formats reach ``module``'s matmuls when it trains (a mode
        that swaps layers: the kinds it swaps). The what-if measures a scaled format on those
        layers only."""
        return True

    def converts_none_of(self, model: nn.Module) -> str:
        """Why the mode, with its options, would convert no layer of ``model`` (it would train
        in bf16), in a sentence; empty where it converts some, or converts no layers at all."""
        return ""

    @contextlib.contextmanager
    def model_scope(self, model: nn.Module, device: torch.device) -> Iterator[Any]:
        """What the mode does to ``model`` for a block, undone exactly on any exit; yields what
        describes the change (None for a mode that leaves the model alone)."""
        yield None

    def prepare_sharded(self, model: nn.Module, device: torch.device) -> bool:
        """Change ``model`` for good before FSDP shards it (sharding replaces its parameters, so
        nothing is put back). Returns whether :meth:`refresh_sharded` must run after each
        optimizer step."""
        return False

    def refresh_sharded(self, model: nn.Module) -> None:
        """After an optimizer step of a sharded model (and at a fit's start): what the mode's
        sharded layers need (fp8: the float8 weights' all-gather scales). A collective."""

    def fsdp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy``: parameters gathered for compute in the autocast dtype,
        gradients reduced in fp32; no casting for a mode without autocast."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = self.autocast_dtype
        return MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None
        )

    def describe(self, device: torch.device) -> str:
        """``"bf16 on cpu"``: the mode of a run, as its title says it."""
        return f"{self.label} on {device}"

    # -- compare ---------------------------------------------------------------------------

    def slow_reason(self, model: nn.Module, device: torch.device) -> str | None:
        """Why this mode is slow for ``model`` on ``device`` (said before a run), or None when it
        is not known to be: by default, an autocast dtype the device emulates."""
        dtype = self.autocast_dtype
        return backend_for(device).emulated(dtype) if dtype is not None else None

    def compare_verdict(self, device: torch.device) -> str:
        """What compare says instead of a speedup: :data:`NO_EFFECT`, :data:`EMULATED`, or empty."""
        return ""

    # -- frameworks' loops -----------------------------------------------------------------

    @property
    def lightning_precision(self) -> str | None:
        """Lightning's ``precision=`` for this mode; None where Lightning has no setting for it."""
        if self.converts_layers:
            return None
        if self.autocast_dtype is not None:
            return {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}.get(
                self.autocast_dtype
            )
        return "32-true" if self.fp32_math is not None else None

    def training_arguments(self, on_cuda: bool) -> dict[str, Any] | None:
        """transformers' ``TrainingArguments`` keywords for this mode (``tf32`` only on CUDA, where
        the Trainer accepts it); None where they cannot ask for it."""
        if self.converts_layers:
            return None
        tf32 = None
        if on_cuda and self.fp32_math is not None:
            tf32 = self.fp32_math is Fp32Math.REDUCED
        return {
            "bf16": self.autocast_dtype == torch.bfloat16,
            "fp16": self.autocast_dtype == torch.float16,
            "tf32": tf32,
        }

    @classmethod
    def found_in(cls, model: nn.Module) -> bool:
        """Whether ``model`` holds this mode's layers (a loop converted them itself)."""
        return False

    def missing_layers(self, framework: str, observed: str) -> str | None:
        """The notice for a loop asked for this mode that trains in ``observed`` because none
        of its layers were converted; None when that cannot be the reason."""
        return None
