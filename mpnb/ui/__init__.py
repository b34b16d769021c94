"""The Jupyter side: IPython magics, ipywidgets and plotly views over the core.

- :mod:`~mpnb.ui.magics`: ``%%autocast``, ``%amp``, ``%tf32``, ``%oplist``, ``%%compare`` and the extension.
- :mod:`~mpnb.ui.widgets`: the control panel, the precision lab, fit buttons, the kernel event pump.
- :mod:`~mpnb.ui.plots`: the dashboard figure, live and text sinks, HTML reports, compare progress.
- :mod:`~mpnb.ui.views`: what the UI provides to the core's :mod:`mpnb.views` hooks.
- :mod:`~mpnb.ui.environment`: where output can go (a notebook kernel or a terminal).

The core never imports this package; ``mpnb/__init__.py`` and ``mpnb.cli`` do. Nothing here
imports IPython, ipywidgets or plotly at module level except the modules that are those adapters.
"""
