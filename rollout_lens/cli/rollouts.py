"""The `rollouts` command: a run's rollouts across steps, filtered, searched and sorted as the
explorer does it (`/runs/{id}/rollouts`), printed as a table, JSON or CSV."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Any

from rollout_lens.cli.base import open_factory
from rollout_lens.cli.numbers import COUNT, POSITIVE, RUN_ID, flags_query, two_places
from rollout_lens.cli.remote import add_remote_options, remote_client
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.textsafe import csv_cell, printable
from rollout_lens.server.store.db import session_scope

COLUMNS = ("id", "step", "group", "index", "vote", "target", "verifier_reward", "true_score",
           "advantage", "sum_logprob", "length", "format_state", "disagree", "abs_diff_max",
           "log_seq_ratio", "completion_head")  # fmt: skip


def add_commands(sub: Any) -> None:
    """Register the command on the CLI's subparsers."""
    found = sub.add_parser(
        "rollouts",
        help="find a run's rollouts across steps: filter, search (-q), sort",
        description="Filters hold together; words in -q must all appear in the completion or "
        "the prompt (word* for a prefix).",
    )
    found.add_argument("run_id", type=RUN_ID)
    found.add_argument("--steps", help="a step or a range A:B (either end open), e.g. 100:200")
    found.add_argument("--group", type=COUNT)
    found.add_argument("--state", help="structural state, e.g. collapse")
    found.add_argument("--format-valid", choices=["true", "false"])
    found.add_argument("--vote")
    found.add_argument("--target")
    for name in ("reward", "true", "adv"):
        found.add_argument(f"--{name}-min", type=float)
        found.add_argument(f"--{name}-max", type=float)
    found.add_argument("--len-min", type=COUNT, help="completion length in tokens, at least")
    found.add_argument("--len-max", type=COUNT)
    found.add_argument(
        "--diff-min", type=float, help="largest |Δlogp| (trainer vs generator), at least"
    )
    found.add_argument("--diff-max", type=float)
    found.add_argument("--ratio-min", type=float, help="sequence ratio (above 0), at least")
    found.add_argument("--ratio-max", type=float)
    found.add_argument("--disagree", action="store_true", help="verifier reward ≠ true score")
    found.add_argument("--alert", action="store_true", help="only steps where an alert fired")
    found.add_argument("-q", "--query", dest="q", help="words to search for")
    found.add_argument("--sort", default="step")
    found.add_argument("--order", choices=["asc", "desc"], default="asc")
    found.add_argument("--limit", type=POSITIVE, default=50, help="rows to print (default 50)")
    found.add_argument("--format", choices=["table", "json", "csv"], default="table")
    add_remote_options(found)
    found.set_defaults(handler=_rollouts)


def _query(args: argparse.Namespace) -> Any:
    from rollout_lens.server.webapp.queries import RolloutQuery

    given = {
        key: getattr(args, key)
        for key in RolloutQuery.model_fields
        if getattr(args, key, None) not in (None, False)
    }
    return flags_query(RolloutQuery, given | {"limit": min(max(args.limit, 1), 200)})


def _rollouts(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.webapp import queries

    query = _query(args)
    rows: list[dict[str, Any]] = []
    lens = remote_client(args, settings)
    if lens is not None:
        filters = query.model_dump(exclude_unset=True, exclude={"after"})
        with lens:
            page = lens.rollouts_page(args.run_id, **filters)
            total, capped = page["total"], page["total_capped"]
            rows += page["rollouts"]
            while page["next"] is not None and len(rows) < args.limit:
                page = lens.rollouts_page(args.run_id, after=page["next"], **filters)
                rows += page["rollouts"]
        return _print(args, rows, total, capped)
    engine, factory = open_factory(settings)
    try:
        with session_scope(factory) as session:
            page = queries.explore(session, run_id=args.run_id, query=query)
            total, capped = page["total"], page["total_capped"]
            rows += page["rollouts"]
            while page["next"] is not None and len(rows) < args.limit:
                query = query.model_copy(update={"after": page["next"]})
                page = queries.explore(session, run_id=args.run_id, query=query)
                rows += page["rollouts"]
    finally:
        engine.dispose()
    return _print(args, rows, total, capped)


def _print(args: argparse.Namespace, rows: list[dict[str, Any]], total: int, capped: bool) -> int:
    rows = rows[: max(args.limit, 0)]
    if args.format == "json":
        print(json.dumps(rows, indent=2, ensure_ascii=False))
    elif args.format == "csv":
        out = csv.writer(sys.stdout, lineterminator="\r\n")
        out.writerow(COLUMNS)
        out.writerows([csv_cell(row[c]) for c in COLUMNS] for row in rows)
    else:
        _table(rows, total, capped)
    return 0


def _table(rows: list[dict[str, Any]], total: int, capped: bool) -> None:
    print(f"{len(rows)} of {total:,}{'+' if capped else ''} matching rollouts")
    if not rows:
        return
    print(f"{'step':>6} {'grp':>4} {'#':>3}  {'vote':<10} {'reward':>6} {'true':>5} {'adv':>7}  "
          f"{'tokens':>6}  {'state':<14} completion")  # fmt: skip
    for r in rows:
        head = printable(r["completion_head"]).replace("\n", " ⏎ ")[:60]
        print(
            f"{r['step']:>6} {r['group']:>4} {r['index']:>3}  {printable(r['vote'] or '—'):<10} "
            f"{r['verifier_reward']:>6.2f} {two_places(r['true_score']):>5} {r['advantage']:>7.3f}  "
            f"{r['length'] if r['length'] is not None else '—':>6}  "
            f"{printable(r['format_state'] or '—'):<14} "
            f"{'≠ ' if r['disagree'] else ''}{head}"
        )
