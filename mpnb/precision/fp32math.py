"""Save, change and exactly restore torch's reduced-precision fp32 math flags.

torch has two APIs for these flags, and they do not mix: after a fine-grained
``fp32_precision`` assignment, ``torch.get_float32_matmul_precision()`` and
``torch.backends.cuda.matmul.allow_tf32`` raise until the settings agree again. The
legacy setter is not its own inverse either (``"high"`` then ``"highest"`` leaves
``cuda.matmul.fp32_precision`` at ``"ieee"`` where it was ``"none"``). So mpnb changes
matmul precision through the legacy setter, which keeps every getter readable, and
restores a :class:`Fp32MathSnapshot` in two steps: the legacy value first, then every
fine-grained value as it was. Where the user's own fine-grained settings already disagree
(the legacy getters raise), torch's hidden legacy value cannot be read back, so mpnb then
changes only fine-grained values, which it can restore exactly.

Example:
    >>> snapshot = Fp32MathSnapshot.capture()
    >>> torch.set_float32_matmul_precision("medium")
    >>> snapshot.restore()
    >>> Fp32MathSnapshot.capture() == snapshot
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import _disable_current_modes

from mpnb.precision.names import Fp32Math

if TYPE_CHECKING:
    from mpnb.precision.backends.base import Backend

__all__: list[str] = []

# The probe's matmul: large enough that oneDNN takes its bf16 path where it has one (~10 ms on a CPU).
_PROBE_SIZE = 512

# Fine-grained fp32_precision settings, as attribute paths under torch.backends.
_PRECISION_PATHS = (
    "cuda.matmul",
    "cudnn.conv",
    "cudnn.rnn",
    "mkldnn.matmul",
    "mkldnn.conv",
    "mkldnn.rnn",
)


def _backend_node(path: str) -> object:
    """``torch.backends`` itself for ``""``, else the node at the dotted path below it."""
    node: object = torch.backends
    for part in filter(None, path.split(".")):
        node = getattr(node, part)
    return node


def _has_fine_grained_api() -> bool:
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


def fine_grained(path: str) -> str | None:
    """``torch.backends.<path>.fp32_precision``, or None on a torch without that API."""
    return _backend_node(path).fp32_precision if _has_fine_grained_api() else None


def set_fine_grained(values: dict[str, str]) -> None:
    """Assign ``torch.backends.<path>.fp32_precision`` for each path (no-op on older torch)."""
    if _has_fine_grained_api():
        for path, value in values.items():
            _backend_node(path).fp32_precision = value


def _read_matmul_precision() -> str | None:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # fine-grained settings disagree: there is no single legacy value
        return None


@dataclasses.dataclass(frozen=True)
class Fp32MathSnapshot:
    """Every fp32-math setting mpnb may touch, as it stood at one moment.

    Attributes:
        matmul_precision: ``torch.get_float32_matmul_precision()``, or None where torch
            refuses to answer because fine-grained settings were mixed in.
        cudnn_allow_tf32: ``torch.backends.cudnn.allow_tf32``, or None where unreadable.
        fine_grained: ``(path, value)`` for each ``torch.backends.<path>.fp32_precision``.
    """

    matmul_precision: str | None
    cudnn_allow_tf32: bool | None
    fine_grained: tuple[tuple[str, str], ...]

    @classmethod
    def capture(cls) -> Fp32MathSnapshot:
        """Read the current settings."""
        try:
            cudnn_allow_tf32: bool | None = torch.backends.cudnn.allow_tf32
        except RuntimeError:
            cudnn_allow_tf32 = None
        values = ()
        if _has_fine_grained_api():
            values = tuple((path, fine_grained(path)) for path in _PRECISION_PATHS)
        return cls(_read_matmul_precision(), cudnn_allow_tf32, values)

    def restore(self) -> None:
        """Put every setting back as it was when this snapshot was captured."""
        if self.matmul_precision is not None:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if self.cudnn_allow_tf32 is not None:
            torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        set_fine_grained(
            {path: value for path, value in self.fine_grained if fine_grained(path) != value}
        )


def read_flags() -> dict[str, object]:
    """Every fp32-math getter torch offers, by name; one that raises reads as ``"error: ..."``.

    Example:
        >>> read_flags()["torch.get_float32_matmul_precision()"]
        'highest'
    """
    getters = {
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
        "torch.backends.cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    }
    if _has_fine_grained_api():
        for path in ("", "cudnn", "mkldnn", *_PRECISION_PATHS):
            if hasattr(_backend_node(path), "fp32_precision"):
                name = ".".join(filter(None, ("torch.backends", path, "fp32_precision")))
                getters[name] = functools.partial(fine_grained, path)
    flags: dict[str, object] = {}
    for name, getter in getters.items():
        try:
            flags[name] = getter()
        except RuntimeError as error:
            flags[name] = f"error: {error}"
    return flags


class Fp32MathSwitch:
    """The one owner of the fp32-math flags that mpnb changes.

    The first change records a :class:`Fp32MathSnapshot`; every later level is applied on
    top of that snapshot, and :meth:`release` restores it exactly. Only one backend's level
    is held at a time: the flags are process-wide.

    Example:
        >>> from mpnb.precision.backends import backend_for
        >>> switch = Fp32MathSwitch()
        >>> switch.set(backend_for("cpu"), Fp32Math.REDUCED)
        >>> torch.get_float32_matmul_precision()
        'medium'
        >>> switch.release()
        >>> torch.get_float32_matmul_precision()
        'highest'
    """

    def __init__(self) -> None:
        self._baseline: Fp32MathSnapshot | None = None
        self._held: tuple[Backend, Fp32Math] | None = None

    @property
    def held(self) -> tuple[Backend, Fp32Math] | None:
        """``(backend, level)`` mpnb holds the flags at, or None when they are as mpnb found them."""
        return self._held

    @property
    def level(self) -> Fp32Math | None:
        """The level mpnb holds, or None when the flags are as mpnb found them."""
        return self._held[1] if self._held else None

    @property
    def backend(self) -> Backend | None:
        """The backend whose flags mpnb holds, or None."""
        return self._held[0] if self._held else None

    def set(self, backend: Backend, level: Fp32Math) -> None:
        """Hold ``level`` on ``backend``'s flags, from the flags as mpnb first found them."""
        if self._baseline is None:
            self._baseline = Fp32MathSnapshot.capture()
        else:
            self._baseline.restore()
        try:
            backend.apply_fp32_math(level, legacy=self._baseline.matmul_precision is not None)
        except BaseException:
            self.release()
            raise
        self._held = (backend, level)

    def release(self) -> None:
        """Restore every flag to what it was before mpnb's first change."""
        if self._baseline is not None:
            self._baseline.restore()
        self._baseline = None
        self._held = None

    def hold(self, held: tuple[Backend, Fp32Math] | None) -> None:
        """Hold the flags at ``(backend, level)`` (what :attr:`held` said), or release them for None."""
        if held is None:
            self.release()
        else:
            self.set(*held)


@contextlib.contextmanager
def exact_fp32_math(backend: Backend) -> Iterator[None]:
    """fp32 matmuls and convolutions in exact fp32 math on ``backend``'s device while the block
    runs (a reference to measure against), every flag as found afterwards.

    Example:
        >>> from mpnb.precision.backends import backend_for
        >>> found = Fp32MathSnapshot.capture()
        >>> torch.set_float32_matmul_precision("medium")
        >>> with exact_fp32_math(backend_for("cpu")):
        ...     torch.get_float32_matmul_precision()
        'highest'
        >>> torch.get_float32_matmul_precision()
        'medium'
        >>> found.restore()
    """
    snapshot = Fp32MathSnapshot.capture()
    try:
        backend.apply_fp32_math(Fp32Math.EXACT, legacy=snapshot.matmul_precision is not None)
        yield
    finally:
        snapshot.restore()


@dataclasses.dataclass(frozen=True)
class ReducedMathProbe:
    """What reduced-precision fp32 math (oneDNN bf16 math, TF32) really does on a device.

    Attributes:
        exact_error: relative error of a seeded fp32 matmul against float64 with exact math.
        reduced_error: the same with reduced (bf16) math requested.
    """

    exact_error: float
    reduced_error: float

    @property
    def has_effect(self) -> bool:
        """True where reduced math changes results (bf16 math is ~1e-3 off, exact fp32 ~1e-7)."""
        return self.reduced_error > 10 * self.exact_error


@functools.cache
def probe_reduced_math(backend: Backend, device: torch.device) -> ReducedMathProbe:
    """Measure once per process and device whether reduced-precision fp32 math changes a matmul.

    Runs one seeded matmul with exact and with reduced math against a float64 reference, with
    autocast off and no dispatch mode watching, whatever the caller has on. The flags are put
    back exactly as found and torch's global random state is not touched.

    Example:
        >>> from mpnb.precision.backends import backend_for
        >>> probe = probe_reduced_math(backend_for("cpu"), torch.device("cpu"))
        >>> probe.exact_error < 1e-5, probe.has_effect in (True, False)
        (True, True)
    """
    found = Fp32MathSnapshot.capture()
    errors = []
    # Measure torch's plain fp32 matmul, whatever the caller has on: autocast (and so any op
    # lists, which act only under it) off, and no dispatch mode (a trace) watching.
    with torch.autocast(device.type, enabled=False), _disable_current_modes():
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=generator, dtype=torch.float32).to(
            device
        )
        b = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=generator, dtype=torch.float32).to(
            device
        )
        reference = a.double() @ b.double()
        try:
            for level in (Fp32Math.EXACT, Fp32Math.REDUCED):
                backend.apply_fp32_math(level, legacy=found.matmul_precision is not None)
                errors.append(
                    float(((a @ b).double() - reference).abs().max() / reference.abs().max())
                )
        finally:
            found.restore()
    return ReducedMathProbe(*errors)
