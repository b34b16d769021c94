"""mpnb: mixed-precision training you can toggle, watch and learn in Jupyter.

Plain Python::

    import mpnb
    with mpnb.autocast("bf16"):          # validated torch.autocast, restored exactly
        out = model(x)
    mpnb.set_mode("bf16")                # the session mode
    with mpnb.fp8_layers(model):         # Linear layers in fp8 (torchao), undone after the block
    with mpnb.mx_layers(model):          # ... in MXFP8 (32-value blocks, a scale each)
        ...
    mpnb.status()                        # where the session stands
    mpnb.panel()                         # the same switches as widgets (in Jupyter)
    mpnb.compare(make_run, modes=["fp32", "bf16"])      # the same run in several modes, side by side
    mpnb.max_batch_size(make_run, modes=["fp32", "bf16"])  # the largest batch that fits, per mode
    mpnb.memory(make_run, modes=["fp32", "bf16"])  # where a step's memory goes, by category
    mpnb.advise(model, (x, y), loss_fn)  # fp16 overflow / underflow per module, and what to do
    mpnb.locate_nonfinite(model, lambda: loss_fn(model(x), y), dtype=torch.float16)  # where inf/NaN began
    mpnb.devices()                       # what this machine can do
    trainer = mpnb.Trainer(model, optimizer, loss_fn)   # AMP training with telemetry
    history = trainer.fit(data)          # live dashboard in a notebook, text elsewhere
    mpnb.set_oplists(mpnb.OpLists.preset("hmp"))        # per-op precision lists, live
    with mpnb.trace() as t:              # which op ran in which dtype, in which module
        loss = loss_fn(model(x), y)

IPython / Jupyter::

    %load_ext mpnb
    %amp bf16          # every following cell runs under bf16 autocast
    %amp fp8 --model net   # net's Linear layers in fp8 (torchao) until the mode changes
    %%autocast -d fp16 # one cell under fp16 autocast
    %tf32 on           # reduced-precision fp32 math
    %oplist add fp32 layer_norm        # per-op precision lists

``import mpnb`` imports torch but never IPython, ipywidgets or plotly.
"""

from __future__ import annotations

from mpnb import examples
from mpnb.analysis import (
    BatchSizeReport,
    Comparison,
    MemoryReport,
    compare,
    max_batch_size,
    memory,
)
from mpnb.errors import DeviceUnavailableError, InvalidChoiceError, MpnbError
from mpnb.numerics.advisor import Advice, advise
from mpnb.numerics.origin import Origin, locate_nonfinite
from mpnb.numerics.whatif import WhatIf, whatif
from mpnb.oplists import OpListOverride, OpLists
from mpnb.oplists.trace import Trace, trace
from mpnb.precision import Mode, autocast, get_mode, get_oplists, hmp, set_mode, set_oplists, tf32
from mpnb.precision.modes.fp8 import fp8_layers
from mpnb.precision.modes.mxfp8 import mx_layers
from mpnb.precision.status import DeviceReport, Status, devices, status
from mpnb.training import AmpStep, FitInterrupted, History, Trainer
from mpnb.ui.views import install as _install_ui_views

# The core asks mpnb.views for its dashboards and figures; the Jupyter ones are the default.
_install_ui_views()

from mpnb._version import __version__ as __version__  # noqa: E402

__all__ = [
    "Mode",
    "autocast",
    "set_mode",
    "get_mode",
    "tf32",
    "fp8_layers",
    "mx_layers",
    "status",
    "devices",
    "Status",
    "DeviceReport",
    "Trainer",
    "locate_nonfinite",
    "Origin",
    "AmpStep",
    "History",
    "FitInterrupted",
    "OpLists",
    "OpListOverride",
    "set_oplists",
    "get_oplists",
    "panel",
    "compare",
    "Comparison",
    "max_batch_size",
    "BatchSizeReport",
    "memory",
    "MemoryReport",
    "advise",
    "Advice",
    "whatif",
    "WhatIf",
    "trace",
    "Trace",
    "hmp",
    "examples",
    "MpnbError",
    "InvalidChoiceError",
    "DeviceUnavailableError",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def panel(trainer=None):
    """Show the control panel (ipywidgets): mode, device, fp32 math and op lists, in sync with the magics.

    With a ``trainer``, its *what if* button runs :func:`whatif` on the last batch of that
    trainer's fit. Returns the :class:`mpnb.ui.widgets.panel.ControlPanel`. Outside a notebook
    it says where the panel shows and what drives the same switches there.

    Example:
        >>> control_panel = panel()
        mpnb: the panel is widgets, shown in a notebook ...
        >>> control_panel.mode.value == get_mode()   # the toggle shows the session's mode
        True
        >>> control_panel.close()
    """
    from mpnb.ui.widgets.panel import panel as show_panel

    return show_panel(trainer)


def load_ipython_extension(ipython) -> None:
    """Called by ``%load_ext mpnb``: registers the magics and the per-cell mode hook.

    Example:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> shell = InteractiveShell.instance()
        >>> load_ipython_extension(shell)
        >>> "amp" in shell.magics_manager.magics["line"]
        True
        >>> unload_ipython_extension(shell)
        >>> InteractiveShell.clear_instance()
    """
    from mpnb.ui.magics.extension import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    """Called by ``%unload_ext mpnb``: removes every hook and restores every switch.

    Example:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> shell = InteractiveShell.instance()
        >>> load_ipython_extension(shell)
        >>> unload_ipython_extension(shell)
        >>> "amp" in shell.magics_manager.magics["line"]
        False
        >>> InteractiveShell.clear_instance()
    """
    from mpnb.ui.magics.extension import unload

    unload(ipython)
