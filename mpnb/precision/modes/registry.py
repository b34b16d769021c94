"""The modes mpnb knows, by name and alias: registered once, asked by everything else.

The CLI, the magics' argument checks and help, the control panel's buttons, ``%amp status``,
compare, the integrations and the docs' table of modes all read this registry: a new mode is a
new module with one :func:`register` call.

Example:
    >>> mode_names()
    ('off', 'fp32', 'tf32', 'fp16', 'bf16', 'fp8')
    >>> parse_mode("half"), parse_mode("fp8:rowwise")
    (Mode('fp16'), Mode('fp8', recipe='rowwise'))
    >>> parse_mode("bf16", recipe="rowwise")
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown option of mode bf16 'recipe'; valid: none. Mode fp8 takes recipe, keep.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.precision.modes.base import Mode

__all__: list[str] = []  # the package lists what users call

_MODES: dict[str, type[Mode]] = {}
_ALIASES: dict[str, str] = {}


def register(mode: type[Mode]) -> type[Mode]:
    """Make ``mode`` (a :class:`~mpnb.precision.modes.base.Mode` subclass) known by its name and
    aliases everywhere mpnb takes a mode. Usable as a class decorator.

    Raises:
        MpnbError: the name or an alias is taken by another mode.

    Example:
        >>> import dataclasses, torch
        >>> @register
        ... @dataclasses.dataclass(frozen=True, eq=False, repr=False)
        ... class Brain16(Mode):
        ...     name, summary, autocast_dtype = "brain16", "bf16 by another name", torch.bfloat16
        >>> parse_mode("BRAIN16").autocast_dtype
        torch.bfloat16
        >>> unregister("brain16")
    """
    if not (isinstance(mode, type) and issubclass(mode, Mode)) or not mode.name:
        raise MpnbError(f"register takes a Mode subclass with a name, got {mode!r}")
    names = (mode.name, *mode.aliases)
    taken = [name for name in names if _ALIASES.get(name, mode.name) != mode.name]
    if taken:
        raise MpnbError(f"mode {mode.name}: {', '.join(taken)} already names another mode")
    _MODES[mode.name] = mode
    _ALIASES.update(dict.fromkeys(names, mode.name))
    return mode


def unregister(name: str) -> None:
    """Forget the mode registered as ``name`` (a test's own mode, once the test ends); a name no
    mode has is ignored.

    Example:
        >>> unregister("no such mode")
        >>> "fp16" in mode_names()
        True
    """
    mode = _MODES.pop(name, None)
    if mode is not None:
        for alias in (mode.name, *mode.aliases):
            _ALIASES.pop(alias, None)


def registered(*, converts_layers: bool | None = None) -> tuple[type[Mode], ...]:
    """The registered mode classes in the order they were registered (only those that do or do
    not convert layers, if asked).

    Example:
        >>> [mode.name for mode in registered(converts_layers=False)]
        ['off', 'fp32', 'tf32', 'fp16', 'bf16']
    """
    return tuple(
        mode
        for mode in _MODES.values()
        if converts_layers is None or mode.converts_layers is converts_layers
    )


def mode_names(*, converts_layers: bool | None = None) -> tuple[str, ...]:
    """The registered modes' names, in order (see :func:`registered`).

    Example:
        >>> mode_names(converts_layers=True)
        ('fp8',)
    """
    return tuple(mode.name for mode in registered(converts_layers=converts_layers))


def reference_name() -> str:
    """The name of the mode compare measures speedups against (fp32).

    Example:
        >>> reference_name()
        'fp32'
    """
    return next(mode.name for mode in registered() if mode.reference)


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One option some registered modes take, as a command line offers it (``--recipe``).

    Attributes:
        name: the option's name; help: what it is; many: a list of names (``--keep a b``);
        choices: the values it takes (empty: any); modes: the modes that take it.
    """

    name: str
    help: str
    many: bool
    choices: tuple[str, ...]
    modes: tuple[str, ...]

    def describe(self) -> str:
        """The help line: ``"fp8 only: torchao's float8 recipe (...); one of tensorwise, ..."``."""
        which = (
            f"{', '.join(self.modes)} only"
            if len(self.modes) == 1
            else f"modes {', '.join(self.modes)}"
        )
        one_of = f"; one of {', '.join(self.choices)}" if self.choices else ""
        return f"{which}: {self.help}{one_of}"


def option_specs() -> list[OptionSpec]:
    """Every option of the registered modes, once each, in order: what the magics and the CLI
    offer as ``--NAME``.

    Example:
        >>> [spec.name for spec in option_specs()], option_specs()[0].describe()
        (['recipe', 'keep'], "fp8 only: torchao's float8 recipe (default tensorwise); one of tensorwise, rowwise, rowwise_with_gw_hp")
    """
    specs: dict[str, OptionSpec] = {}
    for mode in registered():
        for field in mode.option_fields():
            known = specs.get(field.name)
            modes = (*known.modes, mode.name) if known else (mode.name,)
            meta = field.metadata
            specs[field.name] = OptionSpec(
                field.name,
                meta.get("help", ""),
                meta.get("many", False),
                meta.get("choices", ()),
                modes,
            )
    return list(specs.values())


def find_mode(name: str | None) -> Mode | None:
    """The mode ``name`` names with its default options, or None for a name that is no mode
    (a framework's ``"bf16-true"``).

    Example:
        >>> find_mode("fp8"), find_mode("bf16-true")
        (Mode('fp8'), None)
    """
    found = _ALIASES.get(str(name).strip().lower()) if name is not None else None
    return _MODES[found]() if found is not None else None


def mode_found_in(model: Any) -> Mode | None:
    """The mode whose layers ``model`` holds (a loop converted them itself), or None.

    Example:
        >>> import torch
        >>> mode_found_in(torch.nn.Linear(2, 2)) is None
        True
    """
    return next((mode() for mode in registered(converts_layers=True) if mode.found_in(model)), None)


def mode_class(name: str, given: object = None) -> type[Mode]:
    """The mode class named ``name`` (or an alias, in any case).

    Raises:
        InvalidChoiceError: ``name`` names no registered mode (the message quotes ``given``,
            what the user typed, when it is more than the name).
    """
    found = _ALIASES.get(str(name).strip().lower())
    if found is None:
        aliases = ", ".join(alias for alias, mode in _ALIASES.items() if alias != mode)
        shown = name if given is None else given
        raise InvalidChoiceError("mode", shown, mode_names(), f"Aliases: {aliases}.")
    return _MODES[found]


def parse_mode(value: str | Mode, **options: Any) -> Mode:
    """The mode ``value`` names, with ``options`` (None values are left at their defaults).

    ``value`` is a mode object, or a name or alias in any case, optionally followed by a colon
    and the value of the mode's first option (``"fp8:rowwise"``).

    Raises:
        InvalidChoiceError: no such mode, or an option the mode does not take, or a bad value.

    Example:
        >>> parse_mode("fp8", recipe="rowwise", keep=["head"])
        Mode('fp8', recipe='rowwise', keep=('head',))
        >>> parse_mode(parse_mode("fp8"), recipe=None)
        Mode('fp8')
    """
    given = {key: value for key, value in options.items() if value is not None}
    if isinstance(value, Mode):
        return _with_options(value, given) if given else value
    name, colon, first = str(value).partition(":")
    mode = mode_class(name, value)
    if colon:
        fields = mode.option_fields()
        if not fields:
            raise InvalidChoiceError(f"option of mode {mode.name}", first, ["none"])
        given = {fields[0].name: first.strip(), **given}
    return _with_options(mode(), given)


def _with_options(mode: Mode, options: dict[str, Any]) -> Mode:
    valid = [field.name for field in mode.option_fields()]
    for key in options:
        if key not in valid:
            takers = [
                f"Mode {other.name} takes {', '.join(f.name for f in other.option_fields())}"
                for other in registered()
                if any(f.name == key for f in other.option_fields())
            ]
            raise InvalidChoiceError(
                f"option of mode {mode.name}",
                key,
                valid or ["none"],
                f"{'; '.join(takers)}." if takers else "",
            )
    return dataclasses.replace(mode, **options)
