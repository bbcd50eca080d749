"""The browser layer's Chromium: one per test process (each pytest-xdist worker) while it runs this
layer's modules, each test opening contexts of its own on it. Package-scoped, not session-scoped:
Playwright's sync API holds an event loop on the main thread while Chromium runs, and a later
module elsewhere calling asyncio.run() in that process would find it running."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.web_support import chromium_browser


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    yield from chromium_browser()
