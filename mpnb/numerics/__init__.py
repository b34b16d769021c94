"""Numerics: what a model's values do in a low precision, module by module.

- :mod:`~mpnb.numerics.limits`: fp16's limits, named for what they are, and the one underflow share.
- :mod:`~mpnb.numerics.probe`: hooks on named modules (each output and its gradient to a callback).
- :mod:`~mpnb.numerics.watch`: the per-module measuring, sampled through a fit (``watch_numerics``).
- :mod:`~mpnb.numerics.origin`: where a step's first inf/NaN began (a replay, or the next steps).
- :mod:`~mpnb.numerics.fp32_modules`: ``keep_in_fp32``'s reversible remedy.
- :mod:`~mpnb.numerics.advisor`: :func:`~mpnb.numerics.advisor.advise`, one batch measured by
  the watch's engine in fp32 and compared with fp16 and bf16.
- :mod:`~mpnb.numerics.instruments`: the instruments a fit asked for, built in one place; the
  Trainer and the framework loops' telemetry reach this package through it only.

This package imports nothing of itself on import: the Trainer reaches
:mod:`~mpnb.numerics.instruments` while ``mpnb.training`` is still loading.
"""

__all__: list[str] = []
