"""IPython magics: each parses its line with magic_arguments, then calls one core function."""
