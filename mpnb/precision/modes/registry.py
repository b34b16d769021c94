"""The modes mpnb knows, by name and alias: registered once, asked by everything else.

The CLI, the magics' argument checks and help, the control panel's buttons, ``%amp status``,
compare, the integrations and the docs' table of modes all read this registry: a new mode is a
new module with one :func:`register` call.

Example:
    >>> mode_names()
    ('off', 'fp32', 'tf32', 'fp16', 'bf16', 'fp8', 'mxfp8', 'nvfp4')
    >>> parse_mode("half"), parse_mode("fp8:rowwise")
    (Mode('fp16'), Mode('fp8', recipe='rowwise'))
    >>> parse_mode("bf16", recipe="rowwise")
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown option of mode bf16 'recipe'; valid: none. Mode fp8 takes recipe, keep.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch

from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.precision.modes.base import Mode
from mpnb.precision.modes.matmul_format import MatmulFormat

__all__: list[str] = []  # the package lists what users call

_MODES: dict[str, type[Mode]] = {}
_ALIASES: dict[str, str] = {}
#: What a mode's name and aliases may be: what ``%amp NAME`` and ``"name:option"`` carry.
_NAME = re.compile(r"[a-z][a-z0-9_-]*")
#: Words ``%amp`` takes in place of a mode.
_KEPT_WORDS = ("status", "panel")
#: mpnb's own modes, registered as the package loads: they cannot be unregistered (the session,
#: compare and the magics rely on them).
_OWN: set[str] = set()


def register(mode: type[Mode]) -> type[Mode]:
    """Make ``mode`` (a :class:`~mpnb.precision.modes.base.Mode` subclass) known by its name and
    aliases everywhere mpnb takes a mode. Usable as a class decorator.

    Raises:
        MpnbError: not a Mode subclass; a name that is not one lowercase word (letters, digits,
            ``_``, ``-``: what ``%amp NAME`` and ``"name:option"`` can carry), or that a magic
            keeps for itself (``status``, ``panel``); a name or an alias another mode has.

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
    unusable = [name for name in names if not _NAME.fullmatch(str(name)) or name in _KEPT_WORDS]
    if unusable:
        raise MpnbError(
            f"mode {mode.name!r}: {', '.join(map(repr, unusable))} cannot name a mode: one "
            f"lowercase word of letters, digits, _ or -, not {' or '.join(_KEPT_WORDS)}"
        )
    taken = [name for name in names if _MODES.get(_ALIASES.get(name, ""), mode) is not mode]
    if taken:
        raise MpnbError(f"mode {mode.name}: {', '.join(taken)} already names another mode")
    _check_formats(mode)
    _MODES[mode.name] = mode
    _ALIASES.update(dict.fromkeys(names, mode.name))
    return mode


def _check_formats(mode: type[Mode]) -> None:
    """Refuse matmul formats that are not :class:`MatmulFormat` objects, whose names cannot be
    typed or are another format's, or whose ``trains_as`` names no mode."""
    formats = mode.matmul_formats
    if not isinstance(formats, tuple) or not all(isinstance(f, MatmulFormat) for f in formats):
        raise MpnbError(
            f"mode {mode.name}: matmul_formats takes a tuple of MatmulFormat, got {formats!r}"
        )
    owners = {
        f.name: other.name
        for other in _MODES.values()
        if other is not mode
        for f in other.matmul_formats
    }
    names = [f.name for f in formats]
    for name in names:
        if not _NAME.fullmatch(name):
            raise MpnbError(
                f"mode {mode.name}: matmul format {name!r} cannot be typed (%whatif --formats): "
                "one lowercase word of letters, digits, _ or -"
            )
        if name in owners or names.count(name) > 1:
            owner = f"mode {owners[name]}'s" if name in owners else f"mode {mode.name}'s own"
            raise MpnbError(f"mode {mode.name}: matmul format {name!r} is already {owner}")
    for matmul_format in formats:
        if matmul_format.trains_as:
            try:
                _trained_as(matmul_format.trains_as, mode)
            except MpnbError as error:
                raise MpnbError(
                    f"mode {mode.name}: matmul format {matmul_format.name!r} trains_as "
                    f"{matmul_format.trains_as!r}: {error}"
                ) from None


def _trained_as(trains_as: str, declaring: type[Mode]) -> Mode:
    """The mode ``trains_as`` names: the declaring mode (registered or not yet) or another."""
    name, colon, first = trains_as.partition(":")
    if name.strip().lower() not in (declaring.name, *declaring.aliases):
        return parse_mode(trains_as)
    return _labelled(declaring, colon, first, {})


def unregister(name: str) -> None:
    """Forget the mode registered as ``name`` (a test's own mode, once the test ends); a name no
    mode has is ignored.

    Raises:
        MpnbError: ``name`` is one of mpnb's own modes (the session, compare and the magics rely
            on them).

    Example:
        >>> unregister("no such mode")
        >>> unregister("fp32")
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: mode fp32 is one of mpnb's own: it cannot be unregistered
    """
    mode = _MODES.get(name)
    if mode is None:
        return
    if name in _OWN:
        raise MpnbError(f"mode {name} is one of mpnb's own: it cannot be unregistered")
    del _MODES[name]
    for alias in (mode.name, *mode.aliases):
        _ALIASES.pop(alias, None)


def keep_registered() -> None:
    """Make every mode registered so far one of mpnb's own (called once, when
    :mod:`mpnb.precision.modes` has loaded its modules)."""
    _OWN.update(_MODES)


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
        ('fp8', 'mxfp8', 'nvfp4')
    """
    return tuple(mode.name for mode in registered(converts_layers=converts_layers))


def matmul_formats() -> dict[str, MatmulFormat]:
    """The registered modes' matmul formats by name, in the order of the modes (what the
    what-if measures: :mod:`~mpnb.precision.modes.matmul_format`).

    Example:
        >>> tuple(matmul_formats())
        ('fp16', 'bf16', 'fp8', 'fp8_rowwise', 'mxfp8', 'nvfp4')
    """
    return {
        matmul_format.name: matmul_format
        for mode in _MODES.values()
        for matmul_format in mode.matmul_formats
    }


def find_format(name: str) -> MatmulFormat:
    """The registered matmul format ``name``.

    Raises:
        InvalidChoiceError: no mode declares a format of that name (the message names those
            that do).
    """
    formats = matmul_formats()
    if name not in formats:
        mode = _MODES.get(_ALIASES.get(str(name).strip().lower(), ""))
        hint = (
            f"Mode {mode.name} declares no matmul format (its class's matmul_formats)."
            if mode is not None and not mode.matmul_formats
            else ""
        )
        raise InvalidChoiceError("format", name, tuple(formats), hint)
    return formats[name]


def format_mode(name: str) -> Mode:
    """The mode that trains in matmul format ``name``: the format's ``trains_as``, else the mode
    that declares it.

    Example:
        >>> format_mode("fp8_rowwise"), format_mode("bf16")
        (Mode('fp8', recipe='rowwise'), Mode('bf16'))
    """
    matmul_format = find_format(name)
    owner = next(mode for mode in _MODES.values() if matmul_format in mode.matmul_formats)
    try:
        return _trained_as(matmul_format.trains_as or owner.name, owner)
    except MpnbError as error:  # the mode it names was unregistered since
        raise MpnbError(
            f"matmul format {name!r} trains as {matmul_format.trains_as!r}: {error}"
        ) from None


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
        name: the option's name.
        helps: (mode, what the option is for that mode), for each mode that takes it.
        many: a list of names (``--keep a b``, or ``a,b``).
    """

    name: str
    helps: tuple[tuple[str, str], ...]
    many: bool

    def describe(self) -> str:
        """The help line: ``"fp8 only: torchao's float8 recipe (...); one of tensorwise, ..."``."""
        by_help: dict[str, list[str]] = {}  # modes that say the same, said once
        for mode, help in self.helps:
            by_help.setdefault(help, []).append(mode)
        if len(self.helps) == 1:
            return f"{self.helps[0][0]} only: {self.helps[0][1]}"
        return "; ".join(f"{', '.join(modes)}: {help}" for help, modes in by_help.items())

    def read(self, value: object) -> object:
        """The option as a command line gave it: None (not given), a value, or for a list of
        names each name of ``--keep a,b --keep c`` (argparse's lists of lists, or one list)."""
        if not self.many or value is None:
            return value
        groups = value if isinstance(value, list) else [value]
        given = [
            item for group in groups for item in (group if isinstance(group, list) else [group])
        ]
        names = split_names(given)
        if not names or any(not str(item).replace(",", " ").split() for item in given):
            shown = " ".join(repr(item) for item in given)
            raise MpnbError(f"--{self.name} takes names, got {shown}, with none in it")
        return names


def split_names(texts: Iterable[object]) -> tuple[str, ...]:
    """Each name in ``texts``, names separated by commas or spaces (``--keep a,b c``, a panel's
    ``"lm_head, h.11"``).

    Example:
        >>> split_names(["lm_head, h.11", "c"])
        ('lm_head', 'h.11', 'c')
    """
    return tuple(name for text in texts for name in str(text).replace(",", " ").split())


def option_specs() -> list[OptionSpec]:
    """Every option of the registered modes, once each, in order: what the magics and the CLI
    offer as ``--NAME`` (two modes' options of one name share the flag; each mode checks it).

    Example:
        >>> [spec.name for spec in option_specs()], option_specs()[0].describe()
        (['recipe', 'keep'], "fp8 only: torchao's float8 recipe (default tensorwise); one of tensorwise, rowwise, rowwise_with_gw_hp")
    """
    specs: dict[str, OptionSpec] = {}
    for mode in registered():
        for field in mode.option_fields():
            meta = field.metadata
            choices = meta.get("choices", ())
            help = meta.get("help", "") + (f"; one of {', '.join(choices)}" if choices else "")
            known = specs.get(field.name)
            helps = (*(known.helps if known else ()), (mode.name, help))
            many = meta.get("many", False) or (known is not None and known.many)
            specs[field.name] = OptionSpec(field.name, helps, many)
    return list(specs.values())


def option_arguments() -> list[tuple[str, dict[str, Any]]]:
    """``(flag, argparse keywords)`` for every mode option: what a command line (``%amp``,
    ``mpnb train``) offers; :func:`read_options` reads them back.

    Example:
        >>> option_arguments()[1]
        ('--keep', {'help': 'fp8, mxfp8, nvfp4: Linear layers (or modules holding them) to keep in bf16, besides the first and last', 'nargs': '+', 'action': 'append', 'metavar': 'NAME'})
    """
    many = {"nargs": "+", "action": "append", "metavar": "NAME"}
    return [
        (f"--{spec.name}", {"help": spec.describe(), **(many if spec.many else {})})
        for spec in option_specs()
    ]


def read_options(args: Any) -> dict[str, Any]:
    """The mode options an argparse namespace holds (None: not given, the mode's default)."""
    return {spec.name: spec.read(getattr(args, spec.name, None)) for spec in option_specs()}


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
        hint = _lightning_hint(str(name).strip().lower())
        raise InvalidChoiceError("mode", shown, mode_names(), f"Aliases: {aliases}.{hint}")
    return _MODES[found]


def _lightning_hint(name: str) -> str:
    """Where ``name`` is a Lightning precision setting (``"bf16-mixed"``), the mode it is: the
    first registered mode that Lightning's loop runs as that setting; else empty.

    >>> _lightning_hint("16-mixed"), _lightning_hint("int4")
    (" '16-mixed' is Lightning's precision setting for mode fp16.", '')
    """
    for mode in _MODES.values():
        if mode().lightning_precision == name:
            return f" {name!r} is Lightning's precision setting for mode {mode.name}."
    return ""


def parse_mode(value: str | Mode, **options: Any) -> Mode:
    """The mode ``value`` names, with ``options`` (None values are left at their defaults).

    ``value`` is a mode object, or a name or alias in any case, optionally followed by a colon
    and the value of the mode's first option (``"fp8:rowwise"``), or a torch dtype that names a
    mode (``torch.bfloat16``: bf16).

    Raises:
        InvalidChoiceError: no such mode, or an option the mode does not take, or a bad value.

    Example:
        >>> parse_mode("fp8", recipe="rowwise", keep=["head"])
        Mode('fp8', recipe='rowwise', keep=('head',))
        >>> parse_mode(parse_mode("fp8"), recipe=None)
        Mode('fp8')
        >>> parse_mode(torch.bfloat16), parse_mode(torch.float32)
        (Mode('bf16'), Mode('fp32'))
    """
    given = {key: value for key, value in options.items() if value is not None}
    if isinstance(value, Mode):
        return _options_agreeing(value, given) if given else value
    # a torch dtype (torch.bfloat16) names the mode of its name, as autocast takes it
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    name, colon, first = str(value).partition(":")
    return _labelled(mode_class(name, value), colon, first, given)


def chosen_mode(mode: str | Mode | None, default: Mode, **options: Any) -> Mode:
    """The mode a call asks for: ``mode`` with ``options`` as :func:`parse_mode` reads them (a
    keyword that contradicts the mode is refused), or, for None, ``default`` (the session's)
    with the options in place of its own (None values are left as they are).

    >>> chosen_mode(None, parse_mode("fp8", keep=["4"]), keep=["2"], recipe=None)
    Mode('fp8', keep=('2',))
    >>> chosen_mode("bf16", parse_mode("fp8"))
    Mode('bf16')
    """
    if mode is not None:
        return parse_mode(mode, **options)
    given = {key: value for key, value in options.items() if value is not None}
    return _with_options(default, given) if given else default


def _labelled(mode: type[Mode], colon: str, first: str, given: dict[str, Any]) -> Mode:
    """``mode`` with the option a label's ``":first"`` names (when ``colon``), and ``given``."""
    if not colon:
        return _with_options(mode(), given)
    said = mode.label_option()
    if said is None:  # no option, or none a label can say (a list of layer names)
        raise InvalidChoiceError(f"option of mode {mode.name}", first, ["none"])
    labelled = _with_options(mode(), {said.name: first.strip()})
    return _options_agreeing(labelled, given)


def _options_agreeing(mode: Mode, options: dict[str, Any]) -> Mode:
    """``mode`` with ``options``, unless one of them sets an option the mode already set away
    from its default to another value: the mode (or its label) and a keyword would then
    disagree, and neither may silently win.

    >>> _options_agreeing(parse_mode("fp8:rowwise"), {"recipe": "tensorwise"})
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: mode fp8:rowwise already says recipe 'rowwise', and recipe='tensorwise' says another: give the recipe once
    """
    changed = _with_options(mode, options)
    for field in mode.option_fields():
        if field.name not in options:
            continue
        default = (
            field.default
            if field.default_factory is dataclasses.MISSING
            else field.default_factory()
        )
        own = getattr(mode, field.name)
        if own != default and own != getattr(changed, field.name):
            raise MpnbError(
                f"mode {mode.label} already says {field.name} {own!r}, and "
                f"{field.name}={options[field.name]!r} says another: give the {field.name} once"
            )
    return changed


def _with_options(mode: Mode, options: dict[str, Any]) -> Mode:
    fields = {field.name: field for field in mode.option_fields()}
    valid = list(fields)
    for key, value in options.items():
        choices = fields[key].metadata.get("choices", ()) if key in fields else ()
        if choices and str(value).strip().lower() not in choices:
            raise InvalidChoiceError(f"{mode.name} {key}", value, choices)
        if key not in valid:
            takers = [
                f"Mode {other.name} takes {', '.join(f.name for f in other.option_fields())}"
                for other in registered()
                if any(f.name == key for f in other.option_fields())
            ]
            if key == "keep":  # what the what-if's advice for an autocast format goes to
                takers.append("in any mode, trainer.keep_in_fp32(names) runs layers in float32")
            raise InvalidChoiceError(
                f"option of mode {mode.name}",
                key,
                valid or ["none"],
                f"{'; '.join(takers)}." if takers else "",
            )
    return dataclasses.replace(mode, **options)
