"""mpnb._stderr: file descriptor 2 is put back as found, whatever the block does."""

from __future__ import annotations

import os

import pytest

from mpnb._stderr import native_stderr_without


@pytest.mark.parametrize("dropped", [None, lambda line: b"noise" in line])
def test_stderr_is_put_back_after_a_block_that_raises(dropped):
    before = os.fstat(2)
    with pytest.raises(KeyboardInterrupt), native_stderr_without(dropped):
        os.write(2, b"noise\n")
        raise KeyboardInterrupt  # as an interrupt would land mid-block
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
