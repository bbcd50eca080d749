"""The `runs` command: list the runs of the local database or of a dashboard (--url)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rollout_lens.cli.base import open_factory
from rollout_lens.cli.remote import add_remote_options, remote_client
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.textsafe import printable
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.serialize import run_dict


def add_commands(sub: Any) -> None:
    """Register `runs` on the CLI's subparsers."""
    runs = sub.add_parser("runs", help="list runs")
    runs.add_argument("--format", choices=["table", "json"], default="table")
    add_remote_options(runs)
    runs.set_defaults(handler=_runs)


def _runs(args: argparse.Namespace, settings: Settings) -> int:
    lens = remote_client(args, settings)
    if lens is not None:
        with lens:
            runs = lens.runs()
    else:
        engine, factory = open_factory(settings)
        with session_scope(factory) as session:
            runs = [run_dict(r) for r in store.list_runs(session)]
        engine.dispose()
    if args.format == "json":
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print("no runs yet: `rollout-lens train --variant patched --steps 150` records one")
        return 0
    print(f"{'id':>4}  {'status':<10} {'step':>11}  {'acc25':>5}  {'rew25':>5}  name")
    for r in runs:
        # Every text came from a run (a name sent through the web API, say): no terminal
        # escapes get through. The JSON format escapes them already (\u001b).
        print(
            f"{r['id']:>4}  {printable(r['status']):<10} "
            f"{r['current_step']:>5}/{r['total_steps']:<5}  "
            f"{_num(r['recent_true_accuracy'])}  {_num(r['recent_reward'])}  {printable(r['name'])}"
        )
    return 0


def _num(value: Any) -> str:
    return f"{value:5.2f}" if isinstance(value, float) else "    -"
