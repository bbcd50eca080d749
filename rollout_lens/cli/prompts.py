"""The `prompts` command: a run's distinct prompts with what happened to each (the prompt lens,
`/runs/{id}/prompts`), filtered, searched and sorted, printed as a table, JSON or CSV; with
`--jsonl`, the prompts the filters select as a dataset in the chat format a TRL script reads."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Any

from rollout_lens.cli.base import open_factory
from rollout_lens.cli.numbers import POSITIVE, RUN_ID, flags_query, two_places
from rollout_lens.cli.remote import add_remote_options, remote_client
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.textsafe import csv_cell, printable

COLUMNS = ("prompt_id", "groups", "first_step", "last_step", "reward_mean", "true_mean",
           "solved_at", "last_failed", "flips", "zero_spread_share", "forgotten", "label")  # fmt: skip
LOOKS = ("never_solved", "solved", "flipping", "stuck", "forgotten")
SORTS = ("prompt", "label", "groups", "first_step", "last_step", "reward_mean", "true_mean",
         "solved_at", "last_failed", "flips", "zero_spread_share")  # fmt: skip
PAGE = 500  # the API's largest page


def add_commands(sub: Any) -> None:
    """Register the command on the CLI's subparsers."""
    found = sub.add_parser(
        "prompts",
        help="a run's prompts and what happened to each: solved at, flips, no gradient",
        description="Each distinct prompt of the run with its groups, first and last step, mean "
        "reward and true score, the first step a group of it was solved by majority, the last it "
        "failed, its flips between the two and its share of groups with zero reward spread.",
    )
    found.add_argument("run_id", type=RUN_ID)
    found.add_argument(
        "--look",
        choices=LOOKS,
        help="never_solved; solved (at least once); flipping (2+ flips); stuck (no reward "
        "spread in half its groups or more, never solved); forgotten (solved, then failed)",
    )
    found.add_argument("-q", "--query", dest="q", help="words that must all appear in the prompt")
    found.add_argument("--sort", choices=SORTS, default="first_step")
    found.add_argument("--order", choices=["asc", "desc"], default="asc")
    found.add_argument("--limit", type=POSITIVE, default=50, help="rows to print (default 50)")
    found.add_argument("--format", choices=["table", "json", "csv"], default="table")
    found.add_argument(
        "--jsonl",
        action="store_true",
        help="every prompt the filters select (no --limit) as JSON Lines, a TRL dataset's rows: "
        '{"prompt": [{"role", "content"}, ...], "target", ...}',
    )
    add_remote_options(found)
    found.set_defaults(handler=_prompts)


def _query(args: argparse.Namespace) -> Any:
    from rollout_lens.server.webapp.queries import PromptQuery

    given = {"look": args.look, "q": args.q, "sort": args.sort, "order": args.order}
    return flags_query(
        PromptQuery,
        {k: v for k, v in given.items() if v is not None} | {"limit": min(args.limit, PAGE)},
    )


def _prompts(args: argparse.Namespace, settings: Settings) -> int:
    query = _query(args)
    lens = remote_client(args, settings)
    if lens is not None:
        filters = query.model_dump(exclude_unset=True, exclude={"after", "limit"})
        with lens:
            if args.jsonl:
                for chunk in lens.prompts_export_chunks(args.run_id, **filters):
                    sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                return 0
            page = lens.prompts_page(args.run_id, limit=query.limit, **filters)
            rows, total = list(page["prompts"]), page["total"]
            while page["next"] is not None and len(rows) < args.limit:
                page = lens.prompts_page(
                    args.run_id, after=page["next"], limit=query.limit, **filters
                )
                rows += page["prompts"]
        return _print(args, rows, total)
    return _local(args, settings, query)


def _local(args: argparse.Namespace, settings: Settings, query: Any) -> int:
    from rollout_lens.server.store.db import session_scope
    from rollout_lens.server.webapp import queries

    engine, factory = open_factory(settings)
    try:
        with session_scope(factory) as session:
            if args.jsonl:
                for row in queries.export_prompts(session, run_id=args.run_id, query=query):
                    print(json.dumps(row, ensure_ascii=False))
                return 0
            page = queries.prompts_page(session, run_id=args.run_id, query=query)
            rows, total = list(page["prompts"]), page["total"]
            while page["next"] is not None and len(rows) < args.limit:
                query = query.model_copy(update={"after": page["next"]})
                page = queries.prompts_page(session, run_id=args.run_id, query=query)
                rows += page["prompts"]
    finally:
        engine.dispose()
    return _print(args, rows, total)


def _print(args: argparse.Namespace, rows: list[dict[str, Any]], total: int) -> int:
    rows = rows[: args.limit]
    if args.format == "json":
        print(json.dumps(rows, indent=2, ensure_ascii=False))
    elif args.format == "csv":
        out = csv.writer(sys.stdout, lineterminator="\r\n")
        out.writerow(COLUMNS)
        out.writerows([csv_cell(row[c]) for c in COLUMNS] for row in rows)
    else:
        _table(rows, total)
    return 0


def _table(rows: list[dict[str, Any]], total: int) -> None:
    print(f"{len(rows)} of {total:,} prompts")
    if not rows:
        return
    print(f"{'prompt':>7} {'groups':>6} {'steps':>11} {'reward':>6} {'true':>5} {'solved':>6} "
          f"{'failed':>6} {'flips':>5} {'flat':>5}  text")  # fmt: skip
    for r in rows:
        label = printable(r["label"]).replace("\n", " ⏎ ")[:60]
        steps = f"{r['first_step']}–{r['last_step']}"
        print(
            f"{r['prompt_id']:>7} {r['groups']:>6} {steps:>11} {two_places(r['reward_mean']):>6} "
            f"{two_places(r['true_mean']):>5} {_step(r['solved_at']):>6} {_step(r['last_failed']):>6} "
            f"{r['flips']:>5} {two_places(r['zero_spread_share']):>5}  "
            f"{'↺ ' if r['forgotten'] else ''}{label}"
        )


def _step(value: int | None) -> str:
    return "—" if value is None else str(value)
