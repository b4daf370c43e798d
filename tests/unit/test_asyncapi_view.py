"""The AsyncAPI viewer page: the document embedded as data that no text of it can break out
of, read back exactly as written."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from eventbus.asyncapi_view import BUNDLE_URL, asyncapi_html

_EMBEDDED = re.compile(
    r'<script type="application/json" id="asyncapi-document">(.*?)</script>', re.S
)


def embedded(page: str) -> Any:
    [text] = _EMBEDDED.findall(page)
    return json.loads(text)


def test_the_page_embeds_the_document_and_loads_the_viewer() -> None:
    doc = {"asyncapi": "3.0.0", "info": {"title": "orders", "version": "1.2.0"}}
    page = asyncapi_html(doc)
    assert embedded(page) == doc
    assert "<title>orders</title>" in page
    assert f'<script src="{BUNDLE_URL}"></script>' in page
    assert "AsyncApiStandalone.render" in page


def test_no_text_of_the_document_closes_its_element_or_runs() -> None:
    hostile = '</script><script>alert("x")</script><!-- & -->'
    doc = {"info": {"title": hostile, "description": hostile}}
    page = asyncapi_html(doc)
    # one element of data, one viewer script, one call: nothing of the document is markup
    assert page.count("<script") == 3 and page.count("</script>") == 3
    assert embedded(page) == doc
    assert "<title>&lt;/script&gt;&lt;script&gt;alert(&quot;x&quot;)" in page


def test_a_bundle_url_of_ones_own_is_used() -> None:
    page = asyncapi_html({}, bundle_url="/static/viewer.js", css_url="/static/viewer.css")
    assert '<script src="/static/viewer.js"></script>' in page
    assert '<link rel="stylesheet" href="/static/viewer.css">' in page
    assert "unpkg" not in page


@given(st.recursive(st.text(), lambda inner: st.dictionaries(st.text(), inner, max_size=3)))
def test_any_text_round_trips_through_the_page(value: Any) -> None:
    doc = {"info": {"title": "t"}, "x": value}
    page = asyncapi_html(doc)
    assert embedded(page) == doc
