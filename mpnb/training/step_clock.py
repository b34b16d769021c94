"""How long each optimizer step took, as the device ran it, with no host-device sync per step.

On a CPU the host's clock is the device's: a step's time is the host time between the end of
one step and the end of the next. An accelerator runs queued work behind the host, so the
host's clock measures how fast steps are *queued*: when the device is the bottleneck, most
steps read short and the step that waits for the device (a telemetry flush) reads long.
Measured on an H100 (8 linear layers of width 4096, batch 4096, bf16): the median of host
step times read 5.48 ms where the run took 6.30 ms a step, so a bf16 speedup over fp32
read 13% too high. There the clock records a timing event (``torch.Event``) at each step's
end instead, and the time between two events is read once the recorder copies the step's
values to the host (the copy waits for the device anyway).

Example:
    >>> import torch
    >>> clock = StepClock(torch.device("cpu"))
    >>> clock.start()
    >>> step_time = clock.lap()
    >>> isinstance(step_time, float) and step_time >= 0
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__: list[str] = []


class DeviceInterval:
    """The device time between two recorded timing events; read it with :func:`seconds`."""

    __slots__ = ("end", "start")

    def __init__(self, start: torch.Event, end: torch.Event) -> None:
        self.start, self.end = start, end

    def seconds(self) -> float:
        """Seconds between the two events, once the device has passed the second (waits for it)."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def seconds(step_time: float | DeviceInterval | list[float | DeviceInterval]) -> float:
    """A time in seconds, whichever clock took it; a list of parts is their sum.

    >>> seconds(0.25), seconds([0.25, 0.5])
    (0.25, 0.75)
    """
    if isinstance(step_time, list):
        return sum(seconds(part) for part in step_time)
    return step_time.seconds() if isinstance(step_time, DeviceInterval) else step_time


class StepClock:
    """Times windows of work that end at each optimizer step: :meth:`start` when a window's work
    begins (a no-op while one is open), :meth:`lap` at the step's end (which also starts the next
    window there), :meth:`restart` to forget the open window (a pause between fits).
    :meth:`start_anew` and :meth:`stop` time one stretch inside a step (a forward pass)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_events = _timing_events_work(device)
        self._start: float | torch.Event | None = None
        # a mark now: the host's clock itself where it is the device's (no Python call a mark)
        self._mark: Callable[[], float | torch.Event] = (
            self._event if self.uses_events else time.perf_counter
        )

    def start(self, at: float | torch.Event | None = None) -> None:
        """Open a window now (or at ``at``, a mark :meth:`start_anew` returned), unless one is open."""
        if self._start is None:
            self._start = self._mark() if at is None else at

    def lap(self) -> float | DeviceInterval:
        """The open window's time (0.0 when none was open), starting the next window now."""
        end = self._mark()
        start, self._start = self._start, end
        if start is None:
            return 0.0
        return DeviceInterval(start, end) if self.uses_events else end - start

    def restart(self) -> None:
        self._start = None

    def start_anew(self) -> float | torch.Event:
        """Forget an open window and open one now; returns its start mark (to open another clock's
        window at the same moment: ``other.start(clock.start_anew())``)."""
        self._start = self._mark()
        return self._start

    def stop(self) -> float | DeviceInterval | None:
        """The open window's time, closing it (None when none was open)."""
        start, self._start = self._start, None
        if start is None:
            return None
        end = self._mark()
        return DeviceInterval(start, end) if self.uses_events else end - start

    def _event(self) -> torch.Event:
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def __repr__(self) -> str:
        return f"StepClock({self.device}, {'device timing events' if self.uses_events else 'host clock'})"


def _timing_events_work(device: torch.device) -> bool:
    """True where the device is not the host and records timing events (CUDA, HPU, XPU...)."""
    if device.type == "cpu" or not hasattr(torch, "Event"):
        return False
    try:
        torch.Event(device=device, enable_timing=True).record()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True
