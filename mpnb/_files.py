"""Files mpnb writes (histories, op lists, traces, reports) land whole or not at all; files it
reads are regular files, read no further than their size.

:func:`atomic_write` writes to a new file beside the destination and renames it over the
destination once it is complete: a reader never sees half a file, an error leaves the old file
as it was, and a symbolic link someone planted at the destination is replaced, not written
through (``open(path, "w")`` would truncate and fill whatever file the link names).
:func:`open_regular` and :func:`read_regular` refuse a device, a pipe, a socket or a folder
(``/dev/zero``, or a link to it, would be read until memory ran out) before reading a byte.

Example:
    >>> import pathlib, tempfile
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_write(folder / "notes.txt") as file:
    ...     _ = file.write("whole or not at all\\n")
    >>> (folder / "notes.txt").read_text(), [path.name for path in folder.iterdir()]
    ('whole or not at all\\n', ['notes.txt'])
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from mpnb.errors import MpnbError, quoted

__all__: list[str] = []

#: The characters of the destination's name a temporary file keeps: enough to tell whose it is,
#: few enough (at 4 UTF-8 bytes each) that its name stays under most file systems' 255 bytes.
_NAME_KEPT = 40


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], *, newline: str | None = None, binary: bool = False
) -> Iterator[IO[Any]]:
    """A UTF-8 text file (or, with ``binary``, a byte file) to write ``path``'s new content into,
    put in place when the block ends.

    The file is created in ``path``'s own folder (one file system, so the final rename is
    atomic), flushed and synced to disk, then renamed onto ``path`` with :func:`os.replace`.
    It gets the permissions ``open(path, "w")`` would give: those of the file it replaces, or
    0o666 less the umask for a new one (never the 0o600 of :func:`tempfile.mkstemp`).

    Args:
        path: the destination. A symbolic link there is itself replaced by the new file; the
            file it pointed to is left untouched.
        newline: as for :func:`open` (``""`` for the :mod:`csv` module).
        binary: a file of bytes (``torch.save`` writes into one), not of text.

    Raises:
        OSError: the folder is missing or not writable, or ``path`` is a folder. On this or any
            error inside the block (KeyboardInterrupt included) the temporary file is removed
            and ``path`` keeps its old content.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "list.txt"
        >>> _ = path.write_text("old\\n")
        >>> try:
        ...     with atomic_write(path) as file:
        ...         _ = file.write("half of the new")
        ...         raise RuntimeError("the writer fails midway")
        ... except RuntimeError:
        ...     pass
        >>> path.read_text()
        'old\\n'
    """
    destination = os.fspath(path)
    if not destination or (os.path.isdir(destination) and not os.path.islink(destination)):
        # else the content would be written beside the folder, then fail to take its place
        said = "an empty path names the current folder" if not destination else "a folder"
        raise IsADirectoryError(
            errno.EISDIR, f"{said}, not a file: give a file's path", destination or "."
        )
    folder, name = os.path.split(os.path.abspath(destination))
    mode = _mode_of(destination)
    descriptor, temporary = _create_beside(folder, name)
    try:
        opened = (
            os.fdopen(descriptor, "wb")
            if binary
            else os.fdopen(descriptor, "w", encoding="utf-8", newline=newline)
        )
        with opened as file:
            if mode is not None:
                # The replaced file's own permissions, as open(path, "w") keeps them: the umask
                # must not narrow a file the user made wider, nor a private one get wider.
                os.fchmod(file.fileno(), mode)
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _sync_folder(folder)


def _mode_of(path: str) -> int | None:
    """The permissions of the regular file at ``path``, or None where there is none. A link's
    target is never looked at: its permissions are not the destination's."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    return stat.S_IMODE(found.st_mode) & 0o777 if stat.S_ISREG(found.st_mode) else None


def _create_beside(folder: str, name: str) -> tuple[int, str]:
    """A new file in ``folder`` named after ``name``, open for writing. ``O_EXCL`` refuses any name
    that exists, a planted link included, so the file is always one this call made."""
    flags = (
        os.O_WRONLY
        | os.O_CREAT
        | os.O_EXCL
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    while True:
        temporary = os.path.join(folder, f".{name[:_NAME_KEPT]}.{secrets.token_hex(8)}.tmp")
        try:
            # 0o666 as open() asks: the kernel takes the umask off (and applies a folder's default ACL).
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue
        except (FileNotFoundError, NotADirectoryError) as error:  # said of the file asked for
            raise type(error)(
                error.errno,
                f"no folder {folder!r} to write {name!r} in",
                os.path.join(folder, name),
            ) from None


def _sync_folder(folder: str) -> None:
    """Make the rename itself durable: a crash after it must not bring the old file back."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows: folders cannot be opened, nor synced
        return
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # a folder we may write but not read: the new file is in place all the same
        return
    try:
        with contextlib.suppress(OSError):  # some file systems cannot sync a folder: best effort
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def open_regular(path: str | os.PathLike[str], *, what: str = "a file") -> IO[bytes]:
    """``open(path, "rb")``, for a regular file only: a link is followed, and its target must be one.

    The file is opened without waiting (a pipe with no writer would hang ``open``) and looked at
    through its descriptor, so what is checked is what is read.

    Args:
        path: the file.
        what: what the caller reads, for the message (``"a checkpoint"``).

    Raises:
        MpnbError: ``path`` is a device, a pipe, a socket or a folder (named, with what it is).
        FileNotFoundError: there is no such file.

    Example:
        >>> try:
        ...     open_regular("/dev/zero", what="a history")
        ... except MpnbError as error:
        ...     print(error)
        '/dev/zero' is a character device: a history is read from a regular file
    """
    name = os.fspath(path)
    descriptor = os.open(
        name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise MpnbError(f"{name!r} is {file_kind(mode)}: {what} is read from a regular file")
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular(
    path: str | os.PathLike[str], *, what: str = "a file", limit: int | None = None
) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`), no more than its size
    when opened, and no more than ``limit``.

    Raises:
        MpnbError: not a regular file, or larger than ``limit`` bytes (both sizes named).
        FileNotFoundError: there is no such file.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "list.txt"
        >>> _ = path.write_text("softmax\\n")
        >>> read_regular(path, limit=1024)
        b'softmax\\n'
    """
    with open_regular(path, what=what) as file:
        size = os.fstat(file.fileno()).st_size
        if limit is not None and size > limit:
            raise MpnbError(
                f"{os.fspath(path)!r} is {size:,} bytes; {what} is at most {limit:,} bytes"
            )
        return file.read(size)


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``os.stat``'s ``st_mode``) is, in words.

    >>> import os
    >>> file_kind(os.lstat("/dev/null").st_mode)
    'a character device'
    """
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def check_writable_folder(path: str, option: str) -> None:
    """Check, before any training, that the folder ``path`` (given as ``option``) can be created
    and written; leave no trace.

    The folders it had to create for the check are removed again: bad input found later (an
    unknown mode) must leave nothing behind.
    """
    created, folder = [], os.path.abspath(path)
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise MpnbError(
            f"{option} {quoted(path)} cannot be created or written: {error.strerror or error}"
        ) from None
    finally:
        for folder in created:  # deepest first
            if os.path.isdir(folder):
                os.rmdir(folder)
