"""The `rollout-lens` command (`rollout_lens.cli:main`). cli.entry builds its parser from a module
per command; the commands share cli.base and never import the entry point (the `cli` contract in
pyproject.toml)."""

from rollout_lens.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
