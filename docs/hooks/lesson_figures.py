"""MkDocs hook: the plotly.js that draws the lessons' stored figures, copied from the installed
plotly package into the site (``js/plotly.min.js``), so the site loads nothing from another host.

docs/js/lesson-figures.js loads it on a page with a figure (``.mpnb-figure``, written by
notebooks/store_outputs.py) and draws each one.
"""

from __future__ import annotations

import pathlib
import shutil


def on_post_build(config) -> None:
    import plotly

    source = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    target = pathlib.Path(config["site_dir"]) / "js" / "plotly.min.js"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
