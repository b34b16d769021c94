"""Bad input reaches the user as one clear line, changes nothing and writes nothing: magic arguments
follow shell quoting, op-list files are checked for encoding and size, long input is quoted short,
and the ``mpnb`` command validates every argument before any work."""

from __future__ import annotations

import os

import pytest

from mpnb import cli
from tests.conftest import policy_state, run, usage_error


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_magic_arguments_follow_shell_quoting(ip, in_tmp):
    run(ip, "%oplist add fp32 softmax")
    run(ip, '%oplist save "my lists/"')
    assert sorted(os.listdir(in_tmp)) == ["my lists"]
    (in_tmp / "a b.txt").write_text("gelu\n")
    (in_tmp / "c.txt").write_text("softmax\n")
    run(ip, '%oplist load "a b.txt" c.txt')
    run(ip, "import mpnb")
    lists = run(ip, "mpnb.get_oplists()")
    assert sorted(lists.lower) == ["gelu"] and sorted(lists.fp32) == ["softmax"]
    run(ip, "%oplist save 'single quoted'")
    assert "single quoted" in os.listdir(in_tmp)


@pytest.mark.parametrize(
    "content, words",
    [
        (b"linear\n\xff\xfe bad bytes\n", ["bad.txt", "line 2", "UTF-8"]),
        (b"\x00\x01\x02\x89PNG\r\n", ["bad.txt", "line 1", "UTF-8"]),
    ],
    ids=["latin-1", "binary"],
)
def test_an_op_list_file_that_is_not_text_is_a_usage_error_naming_file_and_line(
    ip, in_tmp, content, words
):
    (in_tmp / "bad.txt").write_bytes(content)
    before = policy_state()
    message = usage_error(ip, "%oplist load bad.txt")
    assert all(word in message for word in words), message
    assert policy_state() == before


def test_a_huge_op_list_file_is_refused_with_the_limit(ip, in_tmp):
    from mpnb.oplists.lists import MAX_OP_FILE_BYTES

    (in_tmp / "huge.txt").write_bytes(b"linear\n" * (MAX_OP_FILE_BYTES // 7 + 2))
    message = usage_error(ip, "%oplist load huge.txt")
    assert "huge.txt" in message and "1 MiB" in message


@pytest.mark.parametrize(
    "magic, line",
    [("amp", "{}"), ("oplist", "add fp32 {}"), ("tf32", "{}"), ("oplist", "preset {}")],
)
def test_errors_quote_long_input_short(ip, magic, line):
    from IPython.core.error import UsageError

    big = "x" * 5_000_000
    # called directly: IPython's own $-expansion of a cell line takes minutes on 5 MB
    with pytest.raises(UsageError) as refused:
        ip.magics_manager.magics["line"][magic](line.format(big))
    assert (
        len(str(refused.value)) < 600
        and "characters)" in str(refused.value)
        and "limited to" in str(refused.value)
    )


@pytest.mark.parametrize(
    "line, valid",
    [
        ("%amp bf16 extra", "off, fp32, tf32, fp16, bf16"),
        ("%tf32 on off", "on, off"),
        ("%amp --bogus bf16", "off, fp32, tf32, fp16, bf16"),
    ],
)
def test_an_extra_word_names_the_valid_values(ip, line, valid):
    before = policy_state()
    message = usage_error(ip, line)
    assert valid in message and "usage:" in message, message
    assert policy_state() == before


def test_unknown_op_names_get_close_suggestions_or_none(ip):
    message = usage_error(ip, "%oplist add fp32 not_an_op")
    assert "not_equal_" not in message and "tan_" not in message
    assert "no operator has a close name" in message
    assert "softmax" in usage_error(ip, "%oplist add fp32 sofmax")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "--lr", "-1"], ["--lr", "-1", "positive"]),
        (["train", "--lr", "nan"], ["--lr", "nan", "positive"]),
        (["compare", "--warmup", "-1"], ["--warmup", "-1", "0 or more"]),
        (["compare", "--steps", "abc"], ["--steps", "'abc'", "positive whole number"]),
    ],
)
def test_the_cli_refuses_bad_arguments_in_one_line_with_status_2(in_tmp, capsys, argv, words):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert all(word in error for word in words), error
    assert os.listdir(in_tmp) == []


@pytest.mark.parametrize("command", ["train", "compare"])
def test_an_out_folder_that_cannot_be_written_is_refused_before_training(in_tmp, capsys, command):
    (in_tmp / "taken").write_text("a file where the folder should go")
    status = cli.main([command, "--out", "taken/results", "--steps", "1"])
    assert status == 2
    error = capsys.readouterr()
    assert "taken/results" in error.err and "step" not in error.out  # nothing trained
