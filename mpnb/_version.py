"""The version of mpnb, in one place: the package and its command read it from here."""

__all__: list[str] = []

#: The release (PEP 440): 0.4 in development. pyproject.toml reads it from here.
__version__ = "0.4.0.dev0"
