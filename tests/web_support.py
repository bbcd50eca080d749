"""Helpers for the web tests: an in-process client on a test database, and HTML parsed to a tree."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, make_rollouts, record_step, record_steps, step_record

VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}


CSRF = "test-csrf-token-0123456789abcdefghijklmnopqrstuvwxyz"


def client_for(factory: sessionmaker[Session], **settings: Any) -> TestClient:
    """The app on the test's database (the factory of the `engine` fixture: SQLite or Postgres),
    with further settings (e.g. data_dir, where the embedded broker keeps its messages).

    It talks to the app as the dashboard's own pages do: on a loopback host name, with the
    CSRF cookie and the X-CSRF-Token header its scripts send (tests/web/test_security.py checks
    what happens without them)."""
    url = factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(Settings(database_url=url, **settings), session_factory=factory)
    return browser_like(TestClient(app, base_url="http://127.0.0.1"))


def explorer_pages(client: Any, url: str) -> tuple[list[dict[str, Any]], int]:
    """Every row of an explorer answer from `url` on, following its `next_url`s, and its total
    (the same on every page)."""
    rows: list[dict[str, Any]] = []
    page = client.get(url).json()
    total = page["total"]
    rows += page["rollouts"]
    while page["next_url"]:
        page = client.get(page["next_url"]).json()
        assert page["total"] == total
        rows += page["rollouts"]
    return rows, total


def browser_like(client: TestClient) -> TestClient:
    """A client that sends the CSRF cookie and header of a same-origin page: the header follows
    the cookie, as a page's script reads the token its page was rendered with (sign-in gives a
    new one)."""
    client.cookies.set("rl_csrf", CSRF)
    client.headers["X-CSRF-Token"] = CSRF

    def same_token(request: httpx.Request) -> None:
        if "x-csrf-token" in request.headers and request.headers["x-csrf-token"] == CSRF:
            given = [c.value for c in client.cookies.jar if c.name == "rl_csrf" and c.value]
            fresh = [v for v in given if v != CSRF]  # the server's own (sign-in's), if any
            if fresh:
                request.headers["x-csrf-token"] = fresh[-1]

    client.event_hooks["request"] = [*client.event_hooks["request"], same_token]
    return client


@dataclass
class Node:
    """An element of a parsed page: tag, attributes, children (Nodes and text)."""

    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[Node | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.iter()

    def find_all(
        self, tag: str | None = None, *, cls: str | None = None, **attrs: str
    ) -> list[Node]:
        """Descendants (and self) by tag, class and attribute values (`data_run` means data-run)."""
        wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [
            n
            for n in self.iter()
            if (tag is None or n.tag == tag)
            and (cls is None or cls in n.classes)
            and all(n.attrs.get(k) == v for k, v in wanted.items())
        ]

    def find(self, tag: str | None = None, *, cls: str | None = None, **attrs: str) -> Node:
        """The first match; fails the test when there is none."""
        found = self.find_all(tag, cls=cls, **attrs)
        assert found, f"no <{tag or '*'}> with class={cls} {attrs}"
        return found[0]

    def by_id(self, element_id: str) -> Node:
        return self.find(id=element_id)

    def json(self, element_id: str) -> Any:
        """The JSON a page passes to its script (<script type="application/json" id=...>)."""
        node = self.by_id(element_id)
        assert node.tag == "script" and node.attrs.get("type") == "application/json"
        return json.loads(node.text)


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document")
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(html: str) -> Node:
    """A page as a tree of Nodes (stdlib html.parser: what a browser would build, near enough)."""
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


# --- recorded runs that tell the second seed's story --------------------------------------------

COLLAPSE_CONFIG = {
    "variant": "patched",
    "k": 4,
    "steps": 120,
    "learning_rate": 1e-3,
    "supervision": "interleaved_sft",
    "sft_every": 25,
    "eval_every": 10,
    "seed": 0,
}
PROBE_SPIKE_STEP = 68  # end-of-turn after the opening tag jumps here…
COLLAPSE_STEP = 74  # …and most completions collapse a few steps later


def _smooth(step: int, start: int, end: int, low: float, high: float) -> float:
    if step <= start:
        return low
    if step >= end:
        return high
    return low + (high - low) * (step - start) / (end - start)


def collapse_story(step: int, rng: random.Random) -> tuple[dict[str, float], dict[str, float]]:
    """Per-step values and metrics of a run that learns, collapses at COLLAPSE_STEP after a
    control-token spike at PROBE_SPIKE_STEP, and recovers after an SFT phase (pure)."""
    collapsed = COLLAPSE_STEP <= step < 100
    acc = _smooth(step, 5, 50, 0.2, 0.95) if not collapsed else 0.08
    acc = min(1.0, max(0.0, acc + rng.uniform(-0.06, 0.06)))
    collapse = 0.9 if collapsed else 0.03 + rng.uniform(0, 0.03)
    pollution = 0.04 if not collapsed else 0.02
    no_call = max(0.0, 0.35 - step * 0.01) if not collapsed else 0.03
    healthy = max(0.0, 1 - collapse - pollution - no_call)
    eot = 0.03 + rng.uniform(0, 0.02)
    if PROBE_SPIKE_STEP <= step < 100:
        eot = 0.65 + rng.uniform(0, 0.2)
    values = {
        "reward_mean": acc,
        "true_accuracy": acc,
        "format_valid_rate": 1 - collapse,
        "vote_agreement": _smooth(step, 5, 50, 0.4, 1.0) if not collapsed else 0.3,
        "zero_std_share": 0.2,
        "loss": rng.uniform(-0.05, 0.05),
        "wall_time": 0.4,
    }
    metrics: dict[str, float] = {
        "state/healthy_call": healthy,
        "state/text_pollution": pollution,
        "state/collapse": collapse,
        "state/no_call": no_call,
        "probe/eot_after_open/mean": eot,
        "probe/eot_after_open/p90": min(1.0, eot * 1.6),
        "probe/eot_after_open/max": min(1.0, eot * 2.2),
        "probe/eot_after_open/reward1/mean": eot * 0.5,
        "probe/eot_after_open/reward0/mean": min(1.0, eot * 1.3),
        "probe/eot_after_open/policy/mean": eot,
        # dips in the collapse, but stays above the drop rule (its alerts are tested on their own)
        "probe/open_first/mean": 0.97 - (0.4 if collapsed else 0),
        "probe/close_after_id/mean": 0.95,
        "probe/eot_after_close/mean": 0.96,
        "probe/target_logprob/mean": -2.5 + 2.3 * acc,
        "probe/rival_logprob/mean": -1.5 - 1.5 * acc,
        "probe/id_entropy/mean": 2.0 * (1 - acc),
    }
    if step % int(COLLAPSE_CONFIG["eval_every"]) == 0:
        metrics |= {
            "eval/id": acc,
            "eval/format_ood": acc * 0.6,
            "eval/content_ood": acc * 0.75,
        }
    if step % int(COLLAPSE_CONFIG["sft_every"]) == 0:
        metrics |= {"sft/loss": 1.2 - step / 150, "sft/examples": 12.0}
    return values, metrics


def record_collapse_run(
    factory: sessionmaker[Session], *, name: str = "collapse at lr 1e-3"
) -> int:
    """A completed 120-step run (through the store, as the trainer writes) whose series trigger a
    control-token spike alert and a collapse alert, with evaluations and SFT phases."""
    rng = random.Random(7)
    steps = int(COLLAPSE_CONFIG["steps"])
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name=name,
            model="tiny",
            total_steps=steps,
            group_size=8,
            seed=0,
            variant="patched",
            k=4,
            config=COLLAPSE_CONFIG,
            control_tokens=CONTROL_TOKENS,
            status=RunStatus.completed,
            # enough groups a step that the collapse alert judges one step (rollouts: group 0)
            prompts_per_step=4,
        ).id

    def records() -> Iterator[StepRecord]:
        for step in range(1, steps + 1):
            values, metrics = collapse_story(step, rng)
            rollouts = make_rollouts(rng)
            yield step_record(step, values=values, rollouts=rollouts, metrics=metrics)

    record_steps(factory, run_id, records())  # one recorder for the run, as a trainer's writer
    return run_id


HINT = "Hint: the right tool can evaluate an arithmetic expression."


def record_supervised_run(factory: sessionmaker[Session], *, steps: int = 3) -> int:
    """A run whose groups hold an expert reply (#6) and a hinted rollout (#7) at every step."""
    rng = random.Random(3)
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name="hint + expert",
            model="tiny",
            total_steps=steps,
            group_size=8,
            config={"supervision": "hint", "supervised_per_group": 1},
            control_tokens=CONTROL_TOKENS,
        ).id
    for step in range(1, steps + 1):
        rollouts = make_rollouts(rng)
        expert, hinted = rollouts[6], rollouts[7]
        expert.completion = f"<tool>{expert.target}</tool>"
        expert.meta = expert.meta | {"supervised": "expert"}
        hinted.meta = hinted.meta | {"supervised": "hint", "hint_shown": HINT}
        record_step(factory, run_id, step, rollouts=rollouts)
    return run_id


def loopback(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request to a dashboard this test serves on loopback (plain HTTP). httpx.get and
    httpx.post build a client, and with it a TLS context that loads the CA bundle, at every
    call (35 ms of CPU; the polls and posts of the remote-recording tests made hundreds): not
    verifying, its context loads no bundle (0.5 ms), and no HTTPS is ever reached here."""
    if not url.startswith("http://"):
        raise ValueError(f"loopback() is for the tests' plain-HTTP dashboards, not {url}")
    return httpx.request(method, url, verify=False, **kwargs)


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """The app under uvicorn on a free loopback port, in a thread; yields its base URL."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it); no browser downloads here
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",  # the closed network refuses Chromium's own connections
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_browser() -> Iterator[Any]:
    """Headless Debian Chromium driven by Playwright, for a module-scoped fixture to yield from."""
    import pytest
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def launch_fails_saying_why(base: str, log: Path) -> None:
    """A run launched on the dashboard at `base`, where no torch is installed where it trains,
    ends `failed` with the install to make (`log`: the worker's output, shown if it does not)."""
    import time
    import urllib.request

    request = urllib.request.Request(
        f"{base}/api/runs",
        data=json.dumps({"preset": "patched", "steps": 2}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        (run_id,) = [r["id"] for r in json.loads(response.read())["runs"]]
    run, deadline = {}, time.monotonic() + 120
    while run.get("status") not in ("failed", "completed", "lost") and time.monotonic() < deadline:
        time.sleep(0.5)
        with urllib.request.urlopen(f"{base}/api/runs/{run_id}", timeout=10) as response:
            run = json.loads(response.read())["run"]
    assert run["status"] == "failed", (run, log.read_text() if log.exists() else "no log")
    assert "rollout-lens[train]" in run["error"] and "torch" in run["error"], run["error"]
