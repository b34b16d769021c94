"""Result objects: the session :class:`Status` and the :class:`DeviceReport`.

Both render as readable text (``print``, IPython's pretty printer) and as HTML in notebooks.

Example:
    >>> import mpnb
    >>> print(mpnb.status())  # doctest: +ELLIPSIS
    mpnb status
      mode       off (mpnb changes nothing...)
    ...
"""

from __future__ import annotations

import dataclasses
import textwrap

import torch

from mpnb._render import dtype_name, html_list, html_table, text_table
from mpnb.precision.backends import BACKENDS, Backend, MemorySnapshot
from mpnb.precision.modes import Mode, registered
from mpnb.precision.policy import session

__all__ = ["Status", "DeviceReport", "status", "devices"]


class _Renders:
    """Mixin: ``__str__`` and IPython's pretty printer both show :meth:`to_text`."""

    def to_text(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.to_text()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(self.to_text())

    def __repr__(self) -> str:
        return f"<mpnb.{type(self).__name__}: {self.to_text().splitlines()[0]}>"


@dataclasses.dataclass(frozen=True, repr=False)
class Status(_Renders):
    """Where the session stands: mode, device, autocast, fp32 math, and warnings.

    Attributes:
        mode: the session mode.
        device: the device the session runs on.
        autocast_dtype: the dtype cells autocast to, or None.
        active_here: what autocast is doing on this thread right now, in words.
        fp32_math: the fp32-math state in words.
        memory: the device's memory now.
        warnings: what the user should know.

    Example:
        >>> now = status()
        >>> now.mode, now.autocast_dtype
        (Mode('off'), 'off')
        >>> now.rows()[0]
        ('mode', "off (mpnb changes nothing: torch's own defaults and your settings apply)")
    """

    mode: Mode
    device: str
    autocast_dtype: str
    active_here: str
    fp32_math: str
    memory: MemorySnapshot
    warnings: tuple[str, ...]
    mode_rows: tuple[tuple[str, str], ...] = ()

    def rows(self) -> list[tuple[str, str]]:
        """The status as (label, value) pairs."""
        rows = [
            ("mode", f"{self.mode.label} ({self.mode.summary})"),
            ("device", self.device),
            ("autocast", self.autocast_dtype),
            ("right now", self.active_here),
            ("fp32 math", self.fp32_math),
            ("memory", str(self.memory)),
        ]
        return rows + list(self.mode_rows)

    def to_text(self) -> str:
        lines = ["mpnb status", *(f"  {label:<10} {value}" for label, value in self.rows())]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return (
            "<div class='mpnb-status'><b>mpnb status</b>"
            + html_table(["", ""], self.rows())
            + html_list(list(self.warnings), "mpnb-warnings")
            + "</div>"
        )


def _active_autocast(device_type: str) -> str:
    if not torch.is_autocast_enabled(device_type):
        return f"autocast off on {device_type}"
    return f"{dtype_name(torch.get_autocast_dtype(device_type))} autocast on {device_type}"


def status() -> Status:
    """The session status.

    Example:
        >>> status().mode
        Mode('off')
    """
    device = session.resolved_device()
    backend = BACKENDS[device.type]
    dtype = session.mode.autocast_dtype
    return Status(
        mode=session.mode,
        device=str(device) + ("" if session.device is not None else " (auto-detected)"),
        autocast_dtype=f"{dtype_name(dtype)} in every cell" if dtype else "off",
        active_here=_active_autocast(device.type),
        fp32_math=backend.describe_fp32_math(),
        memory=backend.memory(device.index),
        warnings=tuple(session.warnings()),
        mode_rows=(
            *session.mode.status_rows(device),
            *(
                [
                    ("model", f"{session.held.describe()}, until the mode changes"),
                    *(("", line) for line in session.held.layer_lines()),
                ]
                if session.held
                else []
            ),
        ),
    )


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device type: whether it is here and what it can do for mixed precision."""

    type: str
    label: str
    available: bool
    detail: str
    autocast_dtypes: tuple[str, ...]
    verified: dict[str, str]
    fp32_math: str
    reduced_fp32_math: str
    capabilities: dict[str, object]
    memory: str
    layer_modes: str = "-"

    def to_dict(self) -> dict[str, object]:
        """Plain data, for JSON."""
        return dataclasses.asdict(self)

    def notes(self) -> list[str]:
        """The lines under the table: fp32 math now, what reduced fp32 math does here, memory."""
        return [
            f"{self.type} fp32 math: {self.fp32_math}",
            f"{self.type} reduced fp32 math: {self.reduced_fp32_math}",
            f"{self.type} memory: {self.memory}",
        ]


@dataclasses.dataclass(frozen=True, repr=False)
class DeviceReport(_Renders):
    """The capability report: every backend mpnb knows, present or not.

    Example:
        >>> report = devices(check=False)
        >>> [info.type for info in report.devices]
        ['cuda', 'hpu', 'cpu']
        >>> report["cpu"].available, report["cpu"].autocast_dtypes
        (True, ('bf16', 'fp16'))
    """

    devices: tuple[DeviceInfo, ...]

    def __getitem__(self, device_type: str) -> DeviceInfo:
        return next(d for d in self.devices if d.type == device_type)

    def rows(self) -> list[list[str]]:
        """One row per device type."""
        return [
            [
                info.type,
                "yes" if info.available else "no",
                ", ".join(info.autocast_dtypes) or "-",
                ", ".join(f"{k} -> {v}" for k, v in info.verified.items()) or "-",
                info.layer_modes,
                info.detail,
            ]
            for info in self.devices
        ]

    _HEADERS = (
        "device",
        "present",
        "autocast",
        "checked (Linear output)",
        "layer modes",
        "details",
    )

    def to_text(self) -> str:
        # the table's short columns; a present device's long ones after it, wrapped to a
        # terminal's width (a row of all six ran past 300 characters)
        short, rows = len(self._HEADERS) - 2, self.rows()
        lines = [text_table(self._HEADERS[:short], [row[:short] for row in rows]), ""]
        for info, row in zip(self.devices, rows, strict=True):
            for header, value in zip(self._HEADERS[short:], row[short:], strict=True):
                if value and value != "-":  # an absent device's details: why it is absent
                    lines += textwrap.wrap(
                        f"{info.type} {header}: {value}", 100, subsequent_indent="    "
                    )
            if info.available:
                for note in info.notes():
                    lines += textwrap.wrap(note, 100, subsequent_indent="    ")
        return "\n".join(lines).rstrip()

    def _repr_html_(self) -> str:
        notes = [note for info in self.devices if info.available for note in info.notes()]
        return html_table(self._HEADERS, self.rows()) + html_list(notes, "mpnb-notes")

    def to_dict(self) -> dict[str, object]:
        """Plain data, for JSON."""
        return {"torch": torch.__version__, "devices": [d.to_dict() for d in self.devices]}


def _verify(backend: Backend, dtype: torch.dtype) -> str:
    """Run a tiny Linear under autocast on the device and name the dtype it produced."""
    layer = torch.nn.Linear(8, 8).to(backend.type)
    with torch.autocast(backend.type, dtype=dtype):
        return dtype_name(layer(torch.randn(2, 8, device=backend.type)).dtype)


def _device_info(backend: Backend, check: bool) -> DeviceInfo:
    if not backend.is_available():
        return DeviceInfo(
            backend.type, backend.label, False, backend.unavailable_reason(), (), {}, "", "", {}, ""
        )
    dtypes = backend.autocast_dtypes()
    caps = backend.capabilities()
    detail = ", ".join(f"{k}={v}" for k, v in caps.items())
    verified = {dtype_name(d): _verify(backend, d) for d in dtypes} if check else {}
    return DeviceInfo(
        type=backend.type,
        label=backend.label,
        available=True,
        detail=detail,
        autocast_dtypes=tuple(dtype_name(d) for d in dtypes),
        verified=verified,
        fp32_math=backend.describe_fp32_math(),
        reduced_fp32_math=backend.describe_reduced_fp32_math(),
        capabilities=caps,
        memory=str(backend.memory()),
        layer_modes=_layer_modes(backend),
    )


def _layer_modes(backend: Backend) -> str:
    """How each mode that converts layers runs on ``backend``'s device: ``"fp8: emulated..."``."""
    device = torch.device(backend.type)
    return "; ".join(
        f"{mode.name}: {mode().support(device)}" for mode in registered(converts_layers=True)
    )


def devices(check: bool = True) -> DeviceReport:
    """Report every device type mpnb knows: present?, autocast dtypes, capabilities, memory.

    Args:
        check: run a tiny Linear under each autocast dtype on each present device and
            report the output dtype torch really produced.

    Example:
        >>> devices()["cpu"].verified
        {'bf16': 'bf16', 'fp16': 'fp16'}
    """
    return DeviceReport(tuple(_device_info(backend, check) for backend in BACKENDS.values()))
