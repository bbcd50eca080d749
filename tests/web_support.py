"""Helpers for the web tests: an in-process client on a test database, and HTML parsed to a tree."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from server.app import create_app
from server.config import Settings

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


def client_for(factory: sessionmaker[Session]) -> TestClient:
    """The app on the test's database (the factory of the `engine` fixture: SQLite or Postgres)."""
    url = factory.kw["bind"].url.render_as_string(hide_password=False)
    return TestClient(create_app(Settings(database_url=url), session_factory=factory))


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
