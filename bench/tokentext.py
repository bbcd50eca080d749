"""Tokens-as-text bench: what reading each token as text (server.core.tokentext) costs the export
of one step of --rollouts × --tokens byte-level BPE tokens, against the export that wrote the
raw pieces as `tokens` (measured in the same run, the same data, by patching that one step out).

Data: a synthetic byte-level vocabulary (GPT-2's alphabet: ASCII words as 'Ġword', newlines
'Ċ') and, for a --cjk share of the tokens, CJK characters split over two tokens each (their
first two UTF-8 bytes, then the third): the tokens that take the slow path. A step is written
through the store into a temporary SQLite file, then exported as JSON lines --repeat times each
way, alternating. Printed: ms per export (median), MB written, the ratio, and token_texts alone
over the step's pieces.

    .venv/bin/python -m bench.tokentext [--rollouts 512] [--tokens 1024] [--cjk 0.0] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core import tokentext
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.exchange import export, schema
from rollout_lens.server.store import serialize
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade

CONTROL = ("<tool_call>", "</tool_call>", "<|im_end|>")


def _to_piece() -> dict[int, str]:
    """byte → its byte-level character (bytes_to_unicode)."""
    return {ord(b): chr(c) for c, b in tokentext.byte_level_table().items()}


def vocabulary(rng: random.Random, words: int = 20_000, cjk: int = 2_000) -> list[str]:
    """Byte-level pieces: words with and without their space, newlines, and CJK characters as
    two pieces each (ids 2k and 2k+1 past the words)."""
    table = _to_piece()

    def piece(data: bytes) -> str:
        return "".join(table[b] for b in data)

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["Ċ", "ĊĊ", ".", ",", "<|im_end|>"]
    while len(pieces) < words:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        pieces.append(piece(b" " + word.encode()) if rng.random() < 0.7 else word)
    for code in rng.sample(range(0x4E00, 0x9FFF), cjk):
        data = chr(code).encode()
        pieces += [piece(data[:2]), piece(data[2:])]
    return pieces


def rollouts(
    rng: random.Random, vocab: list[str], n: int, tokens: int, cjk_share: float, words: int
) -> list[RolloutRecord]:
    out = []
    cjk_pairs = (len(vocab) - words) // 2
    for index in range(n):
        ids: list[int] = []
        while len(ids) < tokens - 1:
            if rng.random() < cjk_share / 2:  # a pair is two tokens
                k = words + 2 * rng.randrange(cjk_pairs)
                ids += [k, k + 1]
            else:
                ids.append(rng.randrange(words))
        ids = ids[: tokens - 1] + [4]  # <|im_end|>
        pieces = [vocab[i] for i in ids]
        text = "".join(tokentext.token_texts(pieces[:-1], tokentext.BYTE_LEVEL))
        out.append(
            RolloutRecord(
                group=index // 8, index=index % 8, prompt=f"prompt {index // 8}",
                completion=text, completion_ids=ids,
                token_logprobs=[-rng.random() * 0.1 for _ in ids],
                control_probs={t: [0.0] * len(ids) for t in CONTROL},
                vote=None, target=None, verifier_reward=0.0, true_score=None, advantage=0.0,
                format_valid=None, format_state=None, meta={}, tokens=pieces,
            )
        )  # fmt: skip
    return out


@contextmanager
def pieces_as_tokens() -> Iterator[None]:
    """The export as it was: `tokens` the raw pieces, no `token_pieces` key."""
    original: Callable[..., Any] = schema.rollout_dict
    shown = serialize.shown_tokens

    def before(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        out.pop("token_pieces", None)
        return out

    serialize.shown_tokens = lambda rollout, pieces, *, whole: pieces  # type: ignore[assignment]
    schema.rollout_dict = before  # type: ignore[assignment]
    try:
        yield
    finally:
        serialize.shown_tokens = shown
        schema.rollout_dict = original  # type: ignore[assignment]


def export_once(factory: Any, run_id: int) -> tuple[float, int]:
    start = time.perf_counter()
    with session_scope(factory) as session:
        size = sum(len(c) for c in export.export_chunks(session, run_id=run_id))
    return time.perf_counter() - start, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--cjk", type=float, default=0.0, help="share of tokens in CJK pairs")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    words = 20_000
    vocab = vocabulary(rng, words)
    records = rollouts(rng, vocab, args.rollouts, args.tokens, args.cjk, words)
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(f"sqlite:///{Path(folder) / 'bench.db'}")
        upgrade(engine)
        factory = make_session_factory(engine)
        with session_scope(factory) as session:
            run_id = store.create_run(
                session, name="tokentext", model="m", total_steps=1, group_size=8,
                control_tokens=CONTROL,
            ).id  # fmt: skip
        record = StepRecord(step=1, rollout_step=1, values={}, rollouts=records, metrics={})
        with session_scope(factory) as session:
            store.record_step(session, run_id=run_id, record=record, control_tokens=CONTROL)
        export_once(factory, run_id)  # warm: the token table, the pieces' cache
        now: list[float] = []
        before: list[float] = []
        sizes = {}
        for _ in range(args.repeat):
            with pieces_as_tokens():
                seconds, sizes["before"] = export_once(factory, run_id)
            before.append(seconds)
            seconds, sizes["now"] = export_once(factory, run_id)
            now.append(seconds)
        engine.dispose()
    pieces = [r.tokens or [] for r in records]
    start = time.perf_counter()
    for p in pieces:
        tokentext.token_texts(p, tokentext.BYTE_LEVEL)
    alone = time.perf_counter() - start
    b, n = statistics.median(before), statistics.median(now)
    shape = f"{args.rollouts} rollouts × {args.tokens} tokens, CJK share {args.cjk:.2f}"
    print(f"export of one step ({shape}), median of {args.repeat}:")
    print(f"  raw pieces as tokens (before): {b * 1e3:8.0f} ms  {sizes['before'] / 1e6:6.1f} MB")
    print(f"  texts + token_pieces (now):    {n * 1e3:8.0f} ms  {sizes['now'] / 1e6:6.1f} MB")
    print(f"  ratio now/before: {n / b:.2f}")
    print(f"token_texts alone over the step's pieces: {alone * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
