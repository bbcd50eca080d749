"""The token view's markup (web/templates/macros.html's token_cells and control_table, with
server.webapp.http.templating's token filter): the cached token text escapes every text, a Markup
equal to one included, and the macros escape each cell's hover text and class."""

from __future__ import annotations

import random

from markupsafe import Markup, escape
from rollout_lens.server.webapp.http import templating

HOSTILE = ['<script>alert("x")</script>', "a & b", "it's", '"', "'", "&amp;", "<>", "", "ü≠"]


def test_plain_escaping_is_markupsafes() -> None:
    """The macros' `esc` and `esc_few` filters escape as markupsafe does (they run with
    autoescape off: a Markup object a value was most of their time)."""
    rng = random.Random(7)
    alphabet = "<>&\"' aé\n\x00"
    samples = HOSTILE + [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(12))) for _ in range(500)
    ]
    for value in samples:
        assert templating.escape_str(value) == str(escape(value)), value
        assert templating.escape_few(value) == str(escape(value)), value


def test_a_cached_token_is_escaped_even_after_its_markup_twin() -> None:
    raw = '<b>"x"</b>'
    trusted = Markup(raw)  # equal to the str, and hashed alike: one cache key if not told apart
    first = templating.token_text(trusted)
    second = templating.token_text(raw)
    assert "<b" not in first and "<b" not in second
    assert first == second == str(escape(raw))


def test_cells_escape_their_hover_text_and_class() -> None:
    cell = {"cls": 'tok p1" onmouseover="x', "title": "#0 · <img src=x>", "text": "<i>"}
    macros = templating.make_templates().env.get_template("macros.html").module
    out = str(macros.token_cells([cell]))  # type: ignore[attr-defined]
    assert "<img" not in out and "<i>" not in out and 'onmouseover="x' not in out
    assert "&lt;img src=x&gt;" in out and "&lt;i&gt;" in out


def test_the_control_table_escapes_labels_and_cells() -> None:
    macros = templating.make_templates().env.get_template("macros.html").module
    cells = [{"cls": "tok p1", "title": "t", "text": "<a>"}]
    rows = [("sampled", [("p1", "<0.01")]), ("<tool>", [('c1" x="', "0.50")])]
    out = str(macros.control_table(cells, rows))  # type: ignore[attr-defined]
    assert "<a>" not in out and "&lt;a&gt;" in out and "&lt;0.01" in out
    assert 'x="' not in out and "&lt;tool&gt;" in out
    assert out.startswith('<thead><tr><th scope="col">position</th>') and out.endswith("</tbody>")
