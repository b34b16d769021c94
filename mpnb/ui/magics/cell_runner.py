"""Run a cell magic's body in the user namespace so its exceptions propagate.

``shell.run_cell`` inside a magic prints the body's traceback and returns normally, so the
cell looks successful and context managers around it never see the error. This runs the
body the way ``%%time`` does instead: the exception (KeyboardInterrupt included) travels
out through the magic's ``with`` blocks, and IPython shows its traceback once, with the
body's own line numbers.

Example:
    >>> from IPython.core.interactiveshell import InteractiveShell
    >>> run_cell_body(InteractiveShell.instance(), "x = 2\\nx * 21")
    42
"""

from __future__ import annotations

import ast

__all__: list[str] = []


def run_cell_body(shell, body: str) -> object:
    """Execute ``body`` (IPython syntax allowed) in ``shell``'s namespace.

    Returns:
        The value of a final bare expression, as a normal cell would show it; else None.
    """
    __tracebackhide__ = True
    source = shell.transform_cell(body)
    # One leading newline so that traceback line numbers count the magic's own line too.
    source = "\n" + source
    filename = shell.compile.cache(source, shell.execution_count, raw_code="\n" + body)
    tree = shell.transform_ast(shell.compile.ast_parse(source, filename=filename))
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    namespace = shell.user_ns
    exec(shell.compile(tree, filename, "exec"), shell.user_global_ns, namespace)
    if last is None:
        return None
    return eval(
        shell.compile(ast.Expression(last.value), filename, "eval"), shell.user_global_ns, namespace
    )
