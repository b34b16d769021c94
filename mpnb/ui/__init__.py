"""IPython and widget adapters. Imported only by ``%load_ext mpnb`` and UI entry points."""
