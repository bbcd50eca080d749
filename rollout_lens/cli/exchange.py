"""The `export` and `import` commands: move runs between databases (cli.dumps brings TRL's and
verl's own files in)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_lens.cli.base import migrated_factory, open_factory
from rollout_lens.cli.numbers import RUN_ID
from rollout_lens.cli.remote import add_remote_options, remote_client
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.textsafe import printable
from rollout_lens.server.exchange import export
from rollout_lens.server.store.db import session_scope


def add_commands(sub: Any) -> None:
    """Register the commands on the CLI's subparsers."""
    out = sub.add_parser(
        "export",
        help="write a run to a file: the whole run (to import elsewhere) or its per-step series",
    )
    out.add_argument("run_id", type=RUN_ID)
    out.add_argument("--format", choices=export.FORMATS, default="jsonl")
    out.add_argument(
        "--what",
        choices=export.WHATS,
        default="rollouts",
        help="rollouts: the whole run, importable (default); steps: one row per step, a column "
        "per series",
    )
    out.add_argument("--output", "-o", type=Path, help="file to write (default: stdout)")
    add_remote_options(out)
    out.set_defaults(handler=_export)

    into = sub.add_parser("import", help="create a run from a file written by `export`")
    into.add_argument("file", type=Path)
    into.add_argument("--name", help="the new run's name (default: the exported one)")
    add_remote_options(into)
    into.set_defaults(handler=_import)


def _export(args: argparse.Namespace, settings: Settings) -> int:
    export.check(args.format, args.what)
    lens = remote_client(args, settings)
    if lens is not None:
        with lens:
            _write(lens.export_chunks(args.run_id, format=args.format, what=args.what), args)
        if args.output is not None:
            print(f"run {args.run_id}: {args.what} written to {args.output}", file=sys.stderr)
        return 0
    engine, factory = open_factory(settings)
    try:
        with session_scope(factory) as session:
            # Raises before anything is written when the run does not exist.
            chunks = export.export_chunks(
                session, run_id=args.run_id, fmt=args.format, what=args.what
            )
            _write(chunks, args)
            if args.output is None:
                return 0
    finally:
        engine.dispose()
    print(f"run {args.run_id}: {args.what} written to {args.output}", file=sys.stderr)
    return 0


def _write(chunks: Iterator[bytes], args: argparse.Namespace) -> None:
    """An export's chunks to stdout or to --output (no half-written file left behind)."""
    chunks = iter(chunks)
    first = next(chunks, b"")  # a refusal is raised here, before any file is made
    if args.output is None:
        sys.stdout.buffer.write(first)
        for chunk in chunks:
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        return
    try:
        with args.output.open("wb") as f:
            f.write(first)
            for chunk in chunks:
                f.write(chunk)
    except BaseException:
        args.output.unlink(missing_ok=True)
        raise


def _import(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.exchange.importer import import_export

    if not args.file.is_file():  # before the database is touched (or created)
        raise InvalidInput(f"{args.file}: no such file")
    lens = remote_client(args, settings)
    if lens is not None:
        with lens:
            sent = lens.import_file(args.file, name=args.name)
        print(
            f"imported run {sent['id']} ({printable(sent['name'])}) from {args.file} into "
            f"{lens.base_url}: {sent['steps']} steps, {sent['rollouts']} rollouts"
        )
        print(f"run_id={sent['id']}")
        return 0
    engine, factory = migrated_factory(settings)
    try:
        done = import_export(factory, args.file, name=args.name)
    finally:
        engine.dispose()
    print(
        f"imported run {done.run_id} ({printable(done.name)}) from {args.file}: {done.steps} steps, "
        f"{done.rollouts} rollouts"
    )
    print(f"run_id={done.run_id}")
    return 0
