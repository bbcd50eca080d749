"""Rollout Lens's server side, one package per layer, each importing only those below it:
webapp -> exchange -> store -> core (import-linter keeps it so: see pyproject.toml).
No torch, transformers or trl here.
"""

from pathlib import Path

# The folder that holds web/ and migrations/ beside server/: the repository in a checkout, the
# package in the wheel (pyproject.toml maps them both ways). Found from this package, not from the
# modules that read those folders, so their place inside server/ does not matter.
ROOT = Path(__file__).resolve().parent.parent
