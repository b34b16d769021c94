"""The version of mpnb, in one place: the package and its command read it from here."""

__all__: list[str] = []

#: The release, as pyproject.toml says it.
__version__ = "0.1.0"
