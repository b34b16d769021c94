"""Every docstring example in the package runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import mpnb

MODULES = ["mpnb"] + sorted(
    info.name
    for info in pkgutil.walk_packages(mpnb.__path__, "mpnb.")
    if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
