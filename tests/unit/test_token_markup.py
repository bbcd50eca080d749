"""The token view's hand-built markup (server.webapp.http.templating): its plain-str escaping is
markupsafe's, and the cached token cells escape every text, a Markup equal to one included."""

from __future__ import annotations

import random

from markupsafe import Markup, escape
from rollout_lens.server.webapp.http import templating

HOSTILE = ['<script>alert("x")</script>', "a & b", "it's", '"', "'", "&amp;", "<>", "", "ü≠"]


def test_plain_escaping_is_markupsafes() -> None:
    rng = random.Random(7)
    alphabet = "<>&\"' aé\n\x00"
    samples = HOSTILE + [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(12))) for _ in range(500)
    ]
    for value in samples:
        assert templating.escape_str(value) == str(escape(value)), value


def test_a_cached_token_is_escaped_even_after_its_markup_twin() -> None:
    raw = '<b>"x"</b>'
    trusted = Markup(raw)  # equal to the str, and hashed alike: one cache key if not told apart
    first = templating.token_text(trusted)
    second = templating.token_text(raw)
    assert "<b" not in first and "<b" not in second
    assert first == second == str(escape(raw))


def test_cells_escape_their_hover_text_and_class() -> None:
    cell = {"cls": 'tok p1" onmouseover="x', "title": "#0 · <img src=x>", "text": "<i>"}
    out = templating.token_cells_html([cell])  # type: ignore[list-item]
    assert "<img" not in out and "<i>" not in out and 'onmouseover="x' not in out
    assert "&lt;img src=x&gt;" in out and "&lt;i&gt;" in out
