"""The environment of a Python child process a test starts: this one's, with the checkout first.

A test's child imports mpnb from the checkout under test, whether or not it is installed, and
keeps whatever else this process's ``PYTHONPATH`` reaches (packages a GPU machine keeps outside
site-packages, for one).
"""

from __future__ import annotations

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def child_environment(**extra: str) -> dict[str, str]:
    """``os.environ`` with the checkout in front of ``PYTHONPATH``, and ``extra`` set.

    >>> env = child_environment(MPNB_EXAMPLE="1")
    >>> env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT), env["MPNB_EXAMPLE"]
    (True, '1')
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
