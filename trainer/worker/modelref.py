"""Where a run's model comes from, checked on the host that trains it (pure Python, no torch).

The web app cannot know whether a folder exists on a worker, so RunConfig takes any model name;
the worker (and `rollout-lens train`, which trains where it runs) resolves it here before
training, and a run whose model is not there fails with this module's message.
"""

from __future__ import annotations

import re
from pathlib import Path

from rollout_lens.server.core.task_vocab import REAL, TINY

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelUnavailable(ValueError):
    """The model named by a run is not one this host can load."""


def unusable(model: str) -> str:
    """What a launched run's page says of a model the worker could not use: no more than that.
    Whether a folder exists, or what its files hold, stays in the worker's log (anyone who can
    read the dashboard could otherwise probe the worker's disk by launching `/etc`)."""
    return f"model {model.strip()!r} is not a usable model on this worker (its log says why)"


def check_model(model: str) -> str:
    """`tiny` or the real model's name (both built by the worker on first use), a hub id as
    given, or a local model folder as an absolute path on this host; ModelUnavailable when it
    is a folder that is missing or was not saved with save_pretrained."""
    value = model.strip()
    if value in (TINY, REAL) or _HUB_ID.match(value) and not value.startswith((".", "/", "~")):
        return value
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ModelUnavailable(
            f"model {value!r} is neither `tiny`, a hub id, nor an existing folder on this host"
        )
    if not (path / "config.json").is_file():
        raise ModelUnavailable(
            f"model folder {value!r} has no config.json (not saved with save_pretrained)"
        )
    return str(path.resolve())
