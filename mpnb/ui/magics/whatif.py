"""``%whatif``: which number format each layer of a model can take (the same call as
``mpnb.whatif``).

Example (in IPython)::

    %load_ext mpnb
    %whatif model batch --loss loss_fn
    %whatif trainer                      # a Trainer: its model, the last batch of its fit
    %whatif model batch --formats fp8 mxfp8
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mpnb.errors import MpnbError
from mpnb.numerics.formats import format_names
from mpnb.numerics.whatif import WhatIf, whatif, whatif_of_fit
from mpnb.precision.modes.registry import split_names
from mpnb.ui.magics.arguments import as_usage_error, parse_line

__all__: list[str] = []


@magics_class
class WhatIfMagics(Magics):
    """The what-if magic; see ``%whatif?``."""

    @magic_arguments()
    @argument("model", help="a model (an nn.Module), or an mpnb.Trainer that has fit a step")
    @argument(
        "batch",
        nargs="?",
        help="a batch as the Trainer takes it: (inputs, targets) with --loss, else what the "
        "model takes to compute its own loss; left out for a Trainer (the last batch of its fit)",
    )
    @argument("--loss", help="the loss function, loss(outputs, targets) -> scalar")
    @argument(
        "--formats",
        nargs="+",
        metavar="FORMAT",
        help=f"matmul formats, by spaces or commas (default: all): {', '.join(format_names())}, "
        "and any a registered mode adds",
    )
    @line_magic
    def whatif(self, line: str) -> WhatIf:
        """One fp32 forward and backward on the batch; for every linear layer (and convolution)
        and each of its three matmuls, what each format would do: relative error against fp32,
        overflow and flush shares, scale range. The result shows a table and the layers to
        keep per format (``.recommend(format)``, ``.figure()``, ``.prove(make_run, format)``).
        Names are read in the notebook's namespace.

        Example::

            %whatif model batch --loss loss_fn
            %whatif trainer --formats fp8 mxfp8
        """
        args = parse_line(
            self.whatif, line, f"formats: {', '.join(format_names())}", expressions=True
        )
        formats = None if args.formats is None else split_names(args.formats)
        model = self._value(args.model)
        with as_usage_error():
            if args.batch is None:
                if not hasattr(model, "last_batch"):
                    raise UsageError(
                        f"%whatif {args.model}: give a batch after the model, or name a Trainer "
                        "that has fit a step"
                    )
                if args.loss:
                    raise UsageError(
                        f"%whatif {args.model} --loss: a Trainer's what-if takes the trainer's own "
                        "loss function on its last batch; give --loss with a model and a batch"
                    )
                return whatif_of_fit(model, formats)
            loss = self._value(args.loss) if args.loss else None
            try:
                return whatif(model, self._value(args.batch), loss, formats)
            except MpnbError as error:  # said in Python's words: loss_fn= is --loss here
                said = str(error)
                if "loss_fn=" in said and not args.loss:
                    said += " (in %whatif: --loss LOSS_FN)"
                raise UsageError(said) from None

    def _value(self, expression: str):
        """``expression`` evaluated in the notebook's namespace."""
        try:
            return self.shell.ev(expression)
        except Exception as error:
            raise UsageError(f"%whatif: cannot read {expression!r}: {error}") from None
