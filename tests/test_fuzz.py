"""Property-based fuzz of the magics' argument strings: anything the magic does not accept
is a UsageError that names the bad value and changes nothing."""

from __future__ import annotations

import contextlib
import os
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from mpnb.oplists.lists import PRESETS, aten_overloads
from mpnb.precision.modes import registered
from mpnb.precision.modes.fp8 import RECIPES
from tests.conftest import policy_state

MODE_ALIASES = [name for mode in registered() for name in (mode.name, *mode.aliases)]

VALID_WORDS = [
    "bf16",
    "fp16",
    "fp32",
    "tf32",
    "off",
    "half",
    "bfloat16",
    "status",
    "panel",
    "on",
    "cpu",
    "cpu:0",
    "--device",
    "--dtype",
    "-d",
    "--off",
    "--cache",
    "--no-cache",
    "--fp32",
    "--lower",
    "--trace",
    "linear",
    "softmax,mm",
    "show",
    "add",
    "remove",
    "preset",
    "hmp",
    "load",
    "reset",
    "lower",
    "--modes",
    "fp32,bf16",
    "--steps",
    "--warmup",
    "2",
    "--progress",
    "none",
]
junk = st.text(alphabet=string.ascii_letters + string.digits + "._:", min_size=1, max_size=8)
#: Shell quoting, repeated options, non-ASCII and control characters.
TRICKY_WORDS = [
    '"my lists"',
    "'a b'",
    '"unbalanced',
    "'",
    "--device cpu --device cpu",
    "-d bf16 -d fp16",
    "é",
    "\x00",
]
word = st.one_of(
    st.sampled_from(VALID_WORDS), st.sampled_from(TRICKY_WORDS), junk, st.text(max_size=6)
)
line = st.lists(word, max_size=5).map(" ".join)
fuzz = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@contextlib.contextmanager
def working_directory(path):
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


MAGICS = {
    "amp": lambda ip, args: ip.run_line_magic("amp", args),
    "tf32": lambda ip, args: ip.run_line_magic("tf32", args),
    "autocast": lambda ip, args: ip.run_cell_magic("autocast", args, "probe = 1"),
    "oplist": lambda ip, args: ip.run_line_magic("oplist", args),
    "compare": lambda ip, args: ip.run_cell_magic("compare", args, "probe = 1"),
}


@pytest.mark.parametrize("magic", list(MAGICS))
@fuzz
@given(args=line)
def test_any_argument_string_works_or_is_a_usage_error_that_changes_nothing(
    ip, capsys, tmp_path, magic, args
):
    before, files = policy_state(), sorted(os.listdir(tmp_path))
    try:
        with working_directory(tmp_path):
            MAGICS[magic](ip, args)
    except UsageError:
        assert policy_state() == before
        assert sorted(os.listdir(tmp_path)) == files  # nothing written
    finally:
        ip.run_line_magic("amp", "off")
        ip.run_line_magic("oplist", "reset")
        capsys.readouterr()


_ALL_VALID = (
    set(VALID_WORDS)
    | set(MODE_ALIASES)
    | set(RECIPES)  # fp8's
    | {
        "cuda",
        "hpu",
        "auto",
        "live",
        "text",
    }
)


def is_garbage(word: str) -> bool:
    """Whether no magic option takes ``word``, in any case."""
    return (
        word.lower() not in _ALL_VALID
        and not word.lower().startswith(("cuda", "hpu", "cpu"))
        and not aten_overloads(word.lower())  # op names match in any case
        and word.lower() not in PRESETS
    )


def test_no_mode_name_or_alias_counts_as_garbage():
    assert [name for name in MODE_ALIASES if is_garbage(name.upper())] == []


garbage = junk.filter(is_garbage)


@pytest.mark.parametrize(
    "magic, template",
    [
        ("amp", "{}"),
        ("amp", "bf16 {}"),
        ("amp", "bf16 --device {}"),
        ("tf32", "{}"),
        ("tf32", "on {}"),
        ("autocast", "-d {}"),
        ("autocast", "--device {}"),
        ("autocast", "-d bf16 {}"),
        ("autocast", "-d bf16 --fp32 {}"),
        ("autocast", "--lower linear {}"),
        ("oplist", "{}"),
        ("oplist", "add fp32 linear {}"),
        ("oplist", "remove {} linear"),
        ("oplist", "preset {}"),
        ("compare", "--modes {}"),
        ("compare", "--modes fp32,{}"),
        ("compare", "--progress {}"),
    ],
)
@fuzz
@given(bad=garbage)
def test_a_bad_word_is_named_in_the_error(ip, magic, template, bad):
    before = policy_state()
    with pytest.raises(UsageError) as error:
        MAGICS[magic](ip, template.format(bad))
    assert bad in str(error.value) or bad.lower() in str(error.value)
    assert policy_state() == before


@fuzz
@given(content=st.binary(max_size=300))
def test_any_op_list_file_loads_or_is_a_usage_error_naming_it(ip, tmp_path, content):
    path = tmp_path / "lists.txt"
    path.write_bytes(content)
    before = policy_state()
    try:
        ip.run_line_magic("oplist", f"load {path}")
    except UsageError as error:
        assert "lists.txt" in str(error) and len(str(error)) < 1000
        assert policy_state() == before
    finally:
        ip.run_line_magic("oplist", "reset")
