"""What preparing a step of the user's shape costs the callback's writer thread, in the parts
that grow with the step's tokens.

A step of bench/scale.py's shape (64 groups × 8 rollouts × ~1,024 tokens, 4 control tokens):
its completions are real text (SmolLM2-135M-Instruct's ids of English, Python and six other
languages, bench/scale_real.py) encoded again by the real model's tokenizer, so that every id
is the tokenizer's own. Timed on this thread, nothing else running, median of `--repeat`:

- token pieces: tags.TokenPieces (a table of every id's piece) for each completion, beside the
  tokenizer's own convert_ids_to_tokens (a Python call a token), which it replaced;
- tag layout: tags.TokenBytes.layout of each completion (where multi-token call tags stand);
- the step's summary: summary.summarize (its control-token means and maxima over every position).

These run on the writer's thread of a user's script, holding the GIL the training thread needs,
and on the training thread of a launched run.

    .venv/bin/python -m bench.prepare_scale [--groups 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.scale_data import ScaleRun, Shape


def timed(work: Callable[[], Any], repeat: int) -> float:
    """Median ms of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def real_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer: the converted model's, else read from the GGUF file."""
    from pathlib import Path

    from rollout_lens.server.core.config import get_settings
    from rollout_lens.trainer.builders import pretrained
    from transformers import AutoTokenizer

    cache = Path(get_settings().model_cache_dir)
    if pretrained.is_ready(cache):
        return AutoTokenizer.from_pretrained(str(pretrained.model_dir(cache)))
    gguf = pretrained.installed_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--groups", type=int, default=64, help="groups of 8 rollouts a step")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    from rollout_lens.trainer.recorder import summary, tags

    from bench import scale_real

    tokenizer = real_tokenizer()
    run = ScaleRun(Shape(groups=args.groups, vocab=50_000))
    scale_real.use_real(run)
    step = run.step(1)
    texts = [r.completion for r in step.rollouts]
    rows = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    found = [np.asarray(ids, dtype=np.int64) for ids in rows]
    spoken = [tokenizer.decode(ids, skip_special_tokens=False) for ids in rows]
    tokens = sum(map(len, rows))
    print(
        f"one step: {len(rows)} completions, {tokens:,} of the real tokenizer's tokens, "
        f"{len(run.control_tokens)} control tokens; ms, median of {args.repeat}"
    )

    table = tags.TokenPieces(tokenizer)
    start = time.perf_counter()
    table.of(found[0], rows[0])  # the table, made once a run
    made = (time.perf_counter() - start) * 1000
    assert [table.of(f, r) for f, r in zip(found, rows, strict=True)] == [
        tokenizer.convert_ids_to_tokens(r) for r in rows
    ]
    pieces = timed(lambda: [table.of(f, r) for f, r in zip(found, rows, strict=True)], args.repeat)
    loop = timed(lambda: [tokenizer.convert_ids_to_tokens(r) for r in rows], args.repeat)
    print(
        f"  token pieces       {pieces:8.1f}   (convert_ids_to_tokens: {loop:.1f}; the table once: {made:.1f})"
    )

    laid = tags.TokenBytes(tokenizer, table)  # the preparer's pieces, as the callback shares them
    first = timed(lambda: [laid.layout(r, s) for r, s in zip(rows, spoken, strict=True)], 1)
    layout = timed(
        lambda: [laid.layout(r, s) for r, s in zip(rows, spoken, strict=True)], args.repeat
    )
    print(f"  tag layout         {layout:8.1f}   (the first step, learning its ids: {first:.1f})")

    summed = timed(
        lambda: summary.summarize(step.rollouts, run.shape.group_size, run.control_tokens),
        args.repeat,
    )
    print(f"  step summary       {summed:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
