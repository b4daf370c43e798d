"""An AsyncAPI document as a page a browser renders (``eventbus describe --asyncapi F --html P``,
`eventbus.fastapi.asyncapi_routes`): the document, embedded in the page, drawn by AsyncAPI's own
viewer, the standalone bundle of ``@asyncapi/react-component``
(https://github.com/asyncapi/asyncapi-react, docs/usage/standalone-bundle.md), loaded from a CDN
by default. Nothing is fetched when the page is written; the browser loads the bundle when it
opens the page (pass `bundle_url` and `css_url` for a copy you host, e.g. without Internet).
"""

from __future__ import annotations

import html
import json
from typing import Any

VIEWER_VERSION = "2.6.4"
"""The ``@asyncapi/react-component`` release the page loads by default (it renders AsyncAPI 3.0)."""
BUNDLE_URL = (
    f"https://unpkg.com/@asyncapi/react-component@{VIEWER_VERSION}/browser/standalone/index.js"
)
CSS_URL = f"https://unpkg.com/@asyncapi/react-component@{VIEWER_VERSION}/styles/default.min.css"

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="{css_url}">
</head>
<body>
<div id="asyncapi"></div>
<script type="application/json" id="asyncapi-document">{document}</script>
<script src="{bundle_url}"></script>
<script>
  AsyncApiStandalone.render({{
    schema: JSON.parse(document.getElementById("asyncapi-document").textContent),
    config: {{show: {{sidebar: true}}}},
  }}, document.getElementById("asyncapi"));
</script>
</body>
</html>
"""


def asyncapi_html(
    doc: dict[str, Any], *, bundle_url: str = BUNDLE_URL, css_url: str = CSS_URL
) -> str:
    """The HTML page (text) of the AsyncAPI document `doc` (`eventbus.asyncapi.asyncapi_document`).

    The document travels as JSON in a ``<script type="application/json">`` element, read with
    ``JSON.parse``: never run as script. Its ``<``, ``>`` and ``&`` are written as JSON's
    ``\\u003c``-style escapes, so no text of the document (a model's description, a title) can
    close that element or open another (the HTML spec's "script data" state ends only at
    ``</script``). The title is ``info.title``, HTML-escaped; `bundle_url` and `css_url` are the
    viewer's script and style sheet (default: `VIEWER_VERSION` from unpkg)."""
    text = json.dumps(doc, ensure_ascii=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escape)
    title = str(doc.get("info", {}).get("title", "AsyncAPI"))
    return _PAGE.format(
        title=html.escape(title),
        css_url=html.escape(css_url),
        bundle_url=html.escape(bundle_url),
        document=text,
    )
