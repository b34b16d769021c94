"""Files mpnb writes land whole or not at all, and never through a link planted at their name."""

from __future__ import annotations

import os
import stat

import pytest

from mpnb._files import atomic_write
from tests.planted import assert_link_replaced, files_in, plant_link


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_the_new_content_replaces_a_planted_link_and_its_target_is_left_alone(tmp_path):
    destination = tmp_path / "out" / "history.csv"
    victim = plant_link(destination)
    with atomic_write(destination) as file:
        file.write("new\n")
    assert assert_link_replaced(destination, victim) == "new\n"


def test_a_link_to_a_missing_file_is_replaced_and_no_file_appears_where_it_pointed(tmp_path):
    destination, target = tmp_path / "report.html", tmp_path / "would-be-created"
    destination.symlink_to(target)
    with atomic_write(destination) as file:
        file.write("page")
    assert (
        not target.exists() and not destination.is_symlink() and destination.read_text() == "page"
    )


@pytest.mark.parametrize("error", [RuntimeError("the writer fails midway"), KeyboardInterrupt()])
def test_an_error_midway_leaves_the_old_file_whole_and_no_temporary_file(tmp_path, error):
    destination = tmp_path / "lists.txt"
    destination.write_text("old\n")
    with pytest.raises(type(error)):
        with atomic_write(destination) as file:
            file.write("half of the new")
            raise error
    assert destination.read_text() == "old\n" and files_in(tmp_path) == ["lists.txt"]


def test_a_folder_at_the_destination_is_refused_and_no_temporary_file_is_left(tmp_path):
    (tmp_path / "out.csv").mkdir()
    with pytest.raises(IsADirectoryError):
        with atomic_write(tmp_path / "out.csv") as file:
            file.write("x")
    assert files_in(tmp_path) == ["out.csv"] and files_in(tmp_path / "out.csv") == []


def test_a_new_file_gets_what_open_would_give_it_under_the_umask(tmp_path, umask_022):
    with atomic_write(tmp_path / "new.txt") as file:
        file.write("x")
    with open(tmp_path / "by-open.txt", "w") as file:
        file.write("x")
    assert mode_of(tmp_path / "new.txt") == mode_of(tmp_path / "by-open.txt") == 0o644


@pytest.mark.parametrize("kept", [0o600, 0o664])
def test_a_replaced_file_keeps_its_own_permissions(tmp_path, umask_022, kept):
    destination = tmp_path / "kept.txt"
    destination.write_text("old")
    destination.chmod(kept)
    with atomic_write(destination) as file:
        file.write("new")
    assert mode_of(destination) == kept and destination.read_text() == "new"


def test_a_planted_links_target_lends_the_new_file_none_of_its_permissions(tmp_path, umask_022):
    destination = tmp_path / "out" / "trace.csv"
    victim = plant_link(destination)
    victim.chmod(0o666)
    with atomic_write(destination) as file:
        file.write("rows")
    assert mode_of(destination) == 0o644 and mode_of(victim) == 0o666


def test_text_is_utf8_and_newline_is_passed_on_for_csv(tmp_path):
    with atomic_write(tmp_path / "a.csv", newline="") as file:
        file.write("bf16 ≈ fp32\r\n")
    assert (tmp_path / "a.csv").read_bytes() == "bf16 ≈ fp32\r\n".encode()


def test_a_missing_folder_is_named_with_the_file_asked_for_not_the_temporary(tmp_path):
    destination = tmp_path / "no" / "such" / "run.pt"
    with pytest.raises(FileNotFoundError) as missing:
        with atomic_write(destination, binary=True):
            pass
    said = str(missing.value)
    assert str(destination) in said and "folder" in said and ".tmp" not in said
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("given", ["", ".", "runs"])
def test_a_path_that_names_no_file_is_refused_before_a_byte_is_written(
    tmp_path, monkeypatch, given
):
    # an empty path and a folder wrote the whole content beside the folder, then failed to rename
    (tmp_path / "work" / "runs").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(IsADirectoryError) as refused:
        with atomic_write(given) as file:
            file.write("x")
    assert repr(given or ".") in str(refused.value) and ".tmp" not in str(refused.value)
    assert files_in(tmp_path) == ["work"] and files_in(tmp_path / "work") == ["runs"]
