"""--url and --token: the CLI reading and writing a dashboard through its API (rollout_lens.Client)
instead of the local database."""

from __future__ import annotations

import argparse

from rollout_lens.server.core.config import Settings


def add_remote_options(parser: argparse.ArgumentParser) -> None:
    """--url and --token: read a dashboard through its API instead of the local database."""
    parser.add_argument(
        "--url", help="a dashboard's address (default: ROLLOUT_LENS_URL; none: the local database)"
    )
    parser.add_argument("--token", help="its access or recording token (ROLLOUT_LENS_TOKEN)")


def remote_client(args: argparse.Namespace, settings: Settings):  # type: ignore[no-untyped-def]
    """The Client of the dashboard named by --url (or ROLLOUT_LENS_URL), else None."""
    url = getattr(args, "url", None) or settings.url
    if not url:
        return None
    from rollout_lens.client import Client

    token = getattr(args, "token", None) or settings.token.get_secret_value() or None
    return Client(url, token=token)
