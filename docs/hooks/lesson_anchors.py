"""MkDocs hook: a lesson's headings answer to the anchors its table of contents links to.

mkdocs-jupyter gives a heading an id from all its text, inline code included ("Pitfall 1:
`fp16=True` on a CPU" is ``pitfall-1-fp16true-on-a-cpu``), while the page's table of contents
slugs the text without the code (``pitfall-1-on-a-cpu``): such links landed nowhere. Each
heading whose slug without its code differs gets that id too, on an empty span inside it.
"""

from __future__ import annotations

import html
import re

from markdown.extensions.toc import slugify

_HEADING = re.compile(r'<(h[1-6]) id="([^"]+)">(.*?)</\1>', re.DOTALL)


def _without_code(inner: str) -> str:
    text = re.sub(r"<code>.*?</code>", "", inner, flags=re.DOTALL)
    text = re.sub(r'<a class="anchor-link".*?</a>', "", text, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def on_page_content(content: str, page, **_: object) -> str:
    """Add the code-less anchor to each heading of a lesson page that lacks it."""
    if not page.file.src_path.endswith(".ipynb"):
        return content
    ids = set(re.findall(r'\bid="([^"]+)"', content))

    def add(match: re.Match[str]) -> str:
        tag, anchor, inner = match.groups()
        other = slugify(_without_code(inner), "-")
        if not other or other == anchor or other in ids:
            return match.group(0)
        ids.add(other)
        return f'<{tag} id="{anchor}"><span id="{other}"></span>{inner}</{tag}>'

    return _HEADING.sub(add, content)
