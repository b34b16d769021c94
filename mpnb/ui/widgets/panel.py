"""The control panel: the session's switches as ipywidgets, in sync with the magics both ways.

The panel's state is a traitlets object (:class:`PanelState`); widgets are linked to it and
each change of state calls the same core function a magic calls (``session.set_mode``,
``session.set_tf32``, ``session.oplists.add`` ...). The panel listens to the session, so
``%amp bf16`` in a cell moves the panel's buttons, and a click on the panel changes the mode
the next cell runs in, or, while a fit runs, the mode of its next step. Invalid input is
refused with a visible message and changes nothing; after ``%unload_ext mpnb`` the panel
is disabled with a note.

Given a trainer (``mpnb.panel(trainer)``), the panel has a *what if* button beside the modes:
it runs :func:`mpnb.whatif` on the last batch of the trainer's fit and shows which layers
each format would have to keep (:func:`~mpnb.numerics.whatif.whatif_of_fit`).

Example:
    >>> from mpnb.precision.policy import session
    >>> panel = ControlPanel()
    >>> panel.mode.value = "bf16"          # a click on bf16
    >>> session.mode.label
    'bf16'
    >>> _ = session.set_mode("fp32")       # what %amp fp32 does
    >>> panel.mode.value
    'fp32'
    >>> panel.close(); session.reset()
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Callable

import ipywidgets as widgets
import traitlets

from mpnb.errors import MpnbError
from mpnb.numerics.whatif import whatif_of_fit
from mpnb.oplists.lists import LIST_NAMES, PRESETS
from mpnb.precision.backends import available_device_types, backend_for
from mpnb.precision.modes import mode_names, registered
from mpnb.precision.modes.registry import split_names
from mpnb.precision.names import Fp32Math
from mpnb.precision.policy import Session, session
from mpnb.ui.environment import in_notebook_kernel

__all__ = ["ControlPanel", "panel"]

#: What a panel shown where no notebook draws widgets says instead.
ELSEWHERE = (
    "mpnb: the panel is widgets, shown in a notebook (JupyterLab, Notebook, VS Code); here the "
    "same switches are %amp MODE, %tf32 on|off and %oplist (mpnb.set_mode, mpnb.tf32, "
    "mpnb.set_oplists in a script)"
)


_FP32_MATH_LABEL = "reduced-precision fp32 math (TF32 / bf16 math)"
_BACKQUOTED = re.compile(r"`([^`]+)`")


class PanelState(traitlets.HasTraits):
    """What the panel shows; widgets are linked to these traits."""

    mode = traitlets.Unicode("off")
    device = traitlets.Unicode("")
    reduced_fp32_math = traitlets.Bool(False)
    status = traitlets.Unicode("")
    message = traitlets.Unicode("")
    lists = traitlets.Unicode("")
    enabled = traitlets.Bool(True)


class ControlPanel:
    """Precision mode, device, fp32 math and op lists for ``session``, as widgets.

    Attributes:
        state: the declarative state (:class:`PanelState`).
        widget: the whole panel, to display.
        trainer: the trainer whose last batch the *what if* button measures (None: the button
            is off).

    Example (typing op names and pressing add, as a user does):
        >>> control = ControlPanel()
        >>> control.op_names.value = "softmx"
        >>> control.add_button.click()
        >>> control.message_view.value
        '<span style="color:#b00020">unknown op &#x27;softmx&#x27;; valid: softmax. ...</span>'
        >>> control.op_names.value = "F.softmax"
        >>> control.add_button.click()
        >>> control.lists_view.value, control.op_names.value
        ('op lists: lower: softmax; fp32: -', '')
        >>> control.close(); session.reset()
    """

    def __init__(self, owner: Session = session, trainer: object | None = None) -> None:
        self.session = owner
        self.trainer = trainer
        self.state = PanelState()
        self._shown_in_cell: int | None = None
        self._syncing = False
        self.mode = widgets.ToggleButtons(
            options=mode_names(), description="mode", style={"button_width": "64px"}
        )
        #: per mode, a widget per option it takes (fp8's recipe and kept layers), shown while
        #: the session is in that mode
        self.mode_options = {
            mode.name: {field.name: _option_widget(field) for field in mode.option_fields()}
            for mode in registered()
        }
        self.device = widgets.Dropdown(options=available_device_types(), description="device")
        # its own width, unindented: the default description box cuts a long label off ("...fp32 ma...")
        self.reduced_fp32_math = widgets.Checkbox(
            description=_FP32_MATH_LABEL, indent=False, layout={"width": "auto"}
        )
        self.list_name = widgets.Dropdown(
            options=LIST_NAMES, description="op list", layout={"width": "170px"}
        )
        self.op_names = widgets.Text(
            placeholder="linear, F.softmax, aten::addmm", layout={"width": "260px"}
        )
        self.add_button = widgets.Button(description="add", tooltip="put these ops on the list")
        self.remove_button = widgets.Button(
            description="remove", tooltip="take these ops off the list"
        )
        self.preset = widgets.Dropdown(
            options=list(PRESETS), description="preset", layout={"width": "190px"}
        )
        self.preset_button = widgets.Button(description="load preset")
        self.reset_button = widgets.Button(
            description="reset lists", tooltip="torch's own autocast rules"
        )
        self.lists_view = widgets.HTML()
        self.status_view = widgets.HTML()
        self.message_view = widgets.HTML()
        self.whatif_button = widgets.Button(
            description="what if",
            tooltip="which format each layer can take, measured on the last batch of the fit",
            disabled=trainer is None,
        )
        self.whatif_view = widgets.HTML()
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.mode, self.whatif_button]),
                widgets.HBox(self._option_widgets()),
                widgets.HBox([self.device, self.reduced_fp32_math]),
                widgets.HBox([self.list_name, self.op_names, self.add_button, self.remove_button]),
                widgets.HBox([self.preset, self.preset_button, self.reset_button]),
                self.lists_view,
                self.status_view,
                self.message_view,
                self.whatif_view,
            ]
        )
        for name in ("mode", "device", "reduced_fp32_math"):
            traitlets.link((getattr(self, name), "value"), (self.state, name))
        traitlets.dlink((self.state, "status"), (self.status_view, "value"))
        traitlets.dlink((self.state, "lists"), (self.lists_view, "value"))
        traitlets.dlink((self.state, "message"), (self.message_view, "value"))
        self.state.observe(self._on_enabled, "enabled")
        self.state.observe(self._on_mode, "mode")
        self.state.observe(self._on_device, "device")
        self.state.observe(self._on_fp32_math, "reduced_fp32_math")
        for option in self._option_widgets():
            option.observe(self._on_option, "value")
        self.add_button.on_click(
            lambda _: self._edit_lists(self.session.oplists.add, self.list_name.value)
        )
        self.remove_button.on_click(
            lambda _: self._edit_lists(self.session.oplists.remove, self.list_name.value)
        )
        self.preset_button.on_click(
            lambda _: self._apply(lambda: self.session.oplists.preset(self.preset.value))
        )
        self.reset_button.on_click(lambda _: self._apply(self.session.oplists.reset))
        self.whatif_button.on_click(lambda _: self._whatif())
        self._unsubscribe = owner.subscribe(self._on_session)
        self.refresh()

    # -- core -> panel -------------------------------------------------------------------

    def refresh(self) -> None:
        """Show what the session holds now."""
        self._syncing = True
        try:
            device = self.session.resolved_device()
            if device.type not in self.device.options:
                self.device.options = (*self.device.options, device.type)
            self.state.mode = self.session.mode.name
            for mode, options in self.mode_options.items():
                for name, option in options.items():
                    shown = mode == self.session.mode.name
                    option.layout.display = None if shown else "none"
                    if shown:
                        option.value = _shown(getattr(self.session.mode, name))
            self.state.device = device.type
            self.state.reduced_fp32_math = self.session.fp32_math.level is Fp32Math.REDUCED
            backend = backend_for(device)
            self.reduced_fp32_math.tooltip = backend.describe_reduced_fp32_math()
            self.reduced_fp32_math.description = _FP32_MATH_LABEL + (
                "" if backend.has_fast_fp32_math() else " (no effect on this hardware)"
            )
            self.state.status = _status_html(self.session)
            self.state.lists = _lists_html(self.session)
        finally:
            self._syncing = False

    def _on_session(self, what: str) -> None:
        if what == "unloaded":
            self.state.enabled = False
            self.state.message = _note(
                "mpnb was unloaded: this panel is off. `%load_ext mpnb`, then a new panel."
            )
            return
        self.refresh()

    # -- panel -> core -------------------------------------------------------------------

    def _whatif(self) -> None:
        """The what-if on the last batch of the trainer's fit, shown under the panel."""
        self.whatif_view.value = ""  # no earlier result on show as if it were this one's
        try:
            result = whatif_of_fit(self.trainer)
        except MpnbError as error:
            self.state.message = _note(str(error), error=True)
            return
        except Exception as error:  # the user's model or loss: ipywidgets would swallow it
            self.state.message = _note(
                f"the what-if failed: {type(error).__name__}: {error}", error=True
            )
            return
        self.state.message = ""
        self.whatif_view.value = result._repr_html_()

    def _apply(self, change: Callable[[], object]) -> bool:
        """Run one core call; on bad input show why, change nothing, and show the session as it is."""
        try:
            notes = change()
        except MpnbError as error:
            self.state.message = _note(str(error), error=True)
            self.refresh()
            return False
        self.state.message = _note("; ".join(notes)) if isinstance(notes, list) and notes else ""
        self.refresh()
        return True

    def _on_mode(self, change: dict) -> None:
        if not self._syncing:
            self._apply(
                lambda: self.session.set_mode(
                    change["new"], self.state.device, **self._options_of(change["new"])
                )
            )

    def _on_option(self, _change: dict) -> None:
        if not self._syncing:  # a model the mode holds (%amp fp8 --model) stays held
            name = self.session.mode.name
            self._apply(
                lambda: self.session.set_mode(
                    name, None, model=self._held_model(), **self._options_of(name)
                )
            )

    def _options_of(self, mode: str) -> dict[str, object]:
        """The option widgets' values for ``mode``: a list of names split, empty for the default."""
        options: dict[str, object] = {}
        for name, option in self.mode_options.get(mode, {}).items():
            value = option.value
            if isinstance(option, widgets.Text):
                value = split_names([value]) or None
            options[name] = value
        return options

    def _held_model(self) -> object:
        return self.session.held.model if self.session.held is not None else None

    def _on_device(self, change: dict) -> None:
        if not self._syncing:
            self._apply(
                lambda: self.session.set_mode(
                    self.session.mode, change["new"], model=self._held_model()
                )
            )

    def _option_widgets(self) -> list[widgets.Widget]:
        return [option for options in self.mode_options.values() for option in options.values()]

    def _on_fp32_math(self, change: dict) -> None:
        if not self._syncing:
            self._apply(lambda: self.session.set_tf32(change["new"]))

    def _edit_lists(self, edit: Callable[[str, list[str]], list[str]], which: str) -> None:
        names = [name for name in self.op_names.value.replace(",", " ").split() if name]
        if not names:
            self.state.message = _note(
                "type one or more op names first (e.g. linear, F.softmax)", error=True
            )
            return
        if self._apply(lambda: edit(which, names)):
            self.op_names.value = ""

    def _on_enabled(self, change: dict) -> None:
        for child in (
            self.mode,
            *self._option_widgets(),
            self.device,
            self.reduced_fp32_math,
            self.list_name,
            self.op_names,
        ):
            child.disabled = not change["new"]
        for button in (
            self.add_button,
            self.remove_button,
            self.preset,
            self.preset_button,
            self.reset_button,
        ):
            button.disabled = not change["new"]

    def close(self) -> None:
        """Stop listening to the session and close the widgets."""
        self._unsubscribe()
        pending = [self.widget]
        while pending:
            widget = pending.pop()
            pending.extend(getattr(widget, "children", ()))
            widget.close()

    def __repr__(self) -> str:
        return f"<mpnb.ControlPanel mode={self.state.mode} device={self.state.device}>"

    def _ipython_display_(self) -> None:
        """Display the panel's widgets, once per cell: ``mpnb.panel()`` as a cell's last line has
        already shown it, and the cell's result must not show it again or add a text line.
        Shown again in a later cell, it is another view of the same panel."""
        from IPython import get_ipython
        from IPython.display import display

        shell = get_ipython()
        cell = shell.execution_count if shell is not None else None
        if cell is None or cell != self._shown_in_cell:
            if in_notebook_kernel():
                display(self.widget)
            else:  # a widget's text form is its repr, no panel: say where it shows
                print(ELSEWHERE)
            self._shown_in_cell = cell


def _note(text: str, error: bool = False) -> str:
    """``text`` as HTML: all of it escaped (it may quote what the user typed), then each
    `backquoted` span set in ``<code>``, the panel's own markup."""
    color = "#b00020" if error else "#555"
    shown = _BACKQUOTED.sub(r"<code>\1</code>", html.escape(text))
    return f'<span style="color:{color}">{shown}</span>'


def _status_html(owner: Session) -> str:
    mode = owner.mode
    lines = [
        f"<b>{mode.label}</b> on {html.escape(str(owner.resolved_device()))}: {html.escape(mode.summary)}"
    ]
    lines += [
        f'<span style="color:#a15c00">warning: {html.escape(note)}</span>'
        for note in owner.warnings()
    ]
    return "<br>".join(lines)


def _lists_html(owner: Session) -> str:
    lists = owner.oplists.lists
    if not lists:
        return "op lists: none (torch's own autocast rules)"
    parts = [
        f"{which}: {html.escape(', '.join(sorted(entries))) or '-'}"
        for which, entries in (("lower", lists.lower), ("fp32", lists.fp32))
    ]
    return "op lists: " + "; ".join(parts)


def panel(trainer: object | None = None) -> ControlPanel:
    """Show a control panel for the session and return it (``%amp panel`` does the same); with
    a ``trainer``, its *what if* button measures the last batch of that trainer's fit.

    Outside a notebook (a script, a terminal) there is nothing to draw widgets on: it says so,
    with what drives the same switches there, and returns the panel all the same.

    Example:
        >>> shown = panel()  # doctest: +ELLIPSIS
        mpnb: the panel is widgets, shown in a notebook ...
        >>> shown
        <mpnb.ControlPanel mode=off device=...>
        >>> shown.close()
    """

    control_panel = ControlPanel(trainer=trainer)
    control_panel._ipython_display_()
    return control_panel


def _option_widget(field: dataclasses.Field) -> widgets.Widget:
    """A mode's option as a widget: a dropdown of its choices, else a text of names."""
    help, choices = field.metadata.get("help", ""), field.metadata.get("choices", ())
    if choices:
        return widgets.Dropdown(
            options=choices, description=field.name, tooltip=help, layout={"width": "260px"}
        )
    return widgets.Text(
        description=field.name, placeholder="lm_head, h.11", tooltip=help, layout={"width": "300px"}
    )


def _shown(value: object) -> object:
    """An option's value as its widget shows it: names joined by commas."""
    return ", ".join(value) if isinstance(value, tuple) else value
