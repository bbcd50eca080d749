"""The Jinja environment of the pages: templates from web/templates, URL helpers and filters
(numbers, money and times from server.core.display; probabilities and tokens as the viewer shows them).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import jinja2
from fastapi import Request
from fastapi.templating import Jinja2Templates
from markupsafe import Markup, escape
from rollout_lens.server import ROOT
from rollout_lens.server.core import tokentext
from rollout_lens.server.core.display import fmt_minutes, fmt_money, fmt_num, fmt_pct, fmt_when
from rollout_lens.server.core.records import DISAGREE_AT
from rollout_lens.server.core.textsafe import clip
from rollout_lens.server.core.vocab import WINDOW
from rollout_lens.server.webapp.pages.badges import STATES, call_limit, format_badge
from rollout_lens.server.webapp.pages.cells import NEAR_MISS, RATIO_SCALE, prob_text
from rollout_lens.server.webapp.pages.state_reason import state_reason
from rollout_lens.server.webapp.queries.budget import SHOWN_CHARS
from rollout_lens.server.webapp.queries.group_header import answer_vote, hint_body
from rollout_lens.server.webapp.queries.overview import broken, state_name
from starlette.routing import NoMatchFound

WEB_DIR = ROOT / "web"
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"
CARD_CHARS = 2_000


def _static_versions() -> dict[str, str]:
    """Content hashes of the static files, so a changed file gets a new URL (cache busting)."""
    return {
        path.relative_to(STATIC_DIR).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:10]
        for path in STATIC_DIR.rglob("*")
        if path.is_file()
    }


@jinja2.pass_context
def _url_for(
    context: Any, name: str, /, _query: dict[str, Any] | None = None, **params: Any
) -> str:
    """A root-relative URL of a named route, with an optional query string."""
    request: Request = context["request"]
    path = request.scope.get("root_path", "") + str(request.app.url_path_for(name, **params))
    query = {k: v for k, v in (_query or {}).items() if v not in (None, "")}
    return f"{path}?{urlencode(query, doseq=True)}" if query else path


def _static_url(versions: dict[str, str]) -> Callable[[str], str]:
    """The `static(path)` of the templates: a static file's URL, versioned by its content."""

    def static(path: str) -> str:
        version = versions.get(path)
        return f"/static/{path}" + (f"?v={version}" if version else "")

    return static


@jinja2.pass_context
def _has_route(context: Any, name: str) -> bool:
    """Whether the app serves a route of this name (links to optional pages)."""
    try:
        context["request"].app.url_path_for(name)
    except NoMatchFound:
        return False
    return True


@jinja2.pass_context
def _csrf_token(context: Any) -> str:
    """This browser's CSRF token (security.Guard sets it), for forms and scripts."""
    return str(getattr(context["request"].state, "csrf_token", ""))


@jinja2.pass_context
def _access(context: Any) -> dict[str, bool]:
    """Whether tokens are required, and whether this browser is signed in (the top bar)."""
    state = context["request"].state
    return {
        "enabled": bool(getattr(state, "auth_enabled", False)),
        "signed_in": bool(getattr(state, "signed_in", False)),
    }


def make_templates() -> Jinja2Templates:
    """Jinja2Templates over web/templates: autoescaped, strict about undefined names."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals.update(
        url_for=_url_for,
        static=_static_url(_static_versions()),
        has_route=_has_route,
        window=WINDOW,
        csrf_token=_csrf_token,
        access=_access,
        shown_chars=SHOWN_CHARS,  # of a long text (completion, prompt) a page shows
        card_chars=CARD_CHARS,  # of a completion in compare's compact step card
        # the step viewer's marks (server.webapp.pages.badges, turns; queries.group_header): a rollout's vote and format badges, and
        # what the key under its tabs explains
        answer_vote=answer_vote,
        call_limit=call_limit,
        format_badge=format_badge,
        format_states=STATES,
        near_miss=NEAR_MISS,
        ratio_scale=RATIO_SCALE,  # the token view's log-ratio shades: (class, range of r)
        disagree_reward=DISAGREE_AT,
        broken=broken,  # a rollout's format is bad only when known to be (overview.broken)
        state_name=state_name,  # its state, valid/invalid, or None: not recorded
        state_reason=state_reason,  # why, in words beside the badge (pages.state_reason)
    )
    env.filters.update(
        num=fmt_num,
        prob=prob_text,
        pct=fmt_pct,
        money=fmt_money,
        minutes=fmt_minutes,
        when=fmt_when,
        visible=visible_text,
        token=token_text,
        esc=escape_str,
        esc_few=escape_few,
        piece=_piece_view,
        clip=clip,
        hint_body=hint_body,
    )
    return Jinja2Templates(env=env)


_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _picture(match: re.Match[str]) -> str:
    code = ord(match.group())
    symbol = "\u2421" if code == 0x7F else chr(0x2400 + code)  # Unicode control pictures
    return f'<span class="cc" title="control character U+{code:04X}">{symbol}</span>'


def visible_text(text: str | None) -> Markup:
    """Escaped text whose control characters show as their Unicode pictures (␇) instead of vanishing."""
    escaped = str(escape(text or ""))
    return Markup(_CONTROL_CHARS.sub(_picture, escaped))


# Characters that draw nothing (zero-width joiners and spaces, direction marks, a soft hyphen):
# alone in a token cell they would leave it blank.
_INVISIBLE = re.compile("[\u00ad\u200b-\u200f\u2028-\u202e\u2060-\u2064\ufeff]")


def _invisible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f'<span class="cc" title="invisible character U+{code:04X}">U+{code:04X}</span>'


def token_text(text: str) -> Markup:
    """A token for the token-by-token view: whitespace, control and invisible characters made
    visible. Always escaped, even a Markup (a token is model output)."""
    return _token_markup(str(text))


@functools.lru_cache(maxsize=65_536)
def _token_markup(text: str) -> Markup:
    """token_text of a plain str, cached: a page draws a few thousand cells of a few hundred
    distinct token texts (the key is an exact str, never a Markup equal to one)."""
    if text == "":
        return Markup('<span class="cc">∅</span>')
    escaped = str(escape(text.replace("\n", "↵").replace("\t", "⇥")))
    spaced = escaped.replace(" ", '<span class="sp">·</span>')  # before any markup is added
    return Markup(_INVISIBLE.sub(_invisible, _CONTROL_CHARS.sub(_picture, spaced)))


def _piece_view(piece: str) -> Markup:
    """A raw token piece (a control token's name, 'Ġ<') as the text it stands for (' <'), made
    visible like a token."""
    return token_text(tokentext.piece_text(piece))


def escape_str(value: Any) -> str:
    """`value` as text escaped as markupsafe.escape escapes it (& < > " ' as &amp; &lt; &gt; &#34;
    &#39;), as a plain str: the token view's macros escape some ten thousand classes and hover
    texts a page, and a Markup object each was most of their time."""
    return (
        str(value)
        .replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&#34;")
        .replace("'", "&#39;")
    )


# The same escaping, remembered, for the few texts a page repeats thousands of times: a cell's
# CSS classes, and the control-token table's cells (a class and a probability's text each).
escape_few = functools.lru_cache(maxsize=1 << 14)(escape_str)
