"""`python -m bench.scale --real-text`: the bytes of real text (issue 49, item 3).

A real tokenizer's ids (SmolLM2-135M-Instruct's) of real text in several languages
(scale_data.RealText: English prose, Python, and the machine's German, French, Spanish, Russian,
Chinese and Japanese translations), with logprobs drawn from the real model's own distribution
(scale_data.LogprobSampler), written through the real write path for a few hundred steps into
SQLite and PostgreSQL beside TRL's parquet of the same steps; then each database's bytes a
rollout against the parquet's, and the floor: the order-0 entropy of the ids and of the
logprobs (at the store's precision, 1/LOGPROB_SCALE nat) the databases hold, as bytes a
rollout, so that the distance to the limit of any coder that sees one value at a time is a
figure. Control-token probabilities stay the synthetic's (the real model has no tool tags).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store.arrays import LOGPROB_FLOOR, LOGPROB_SCALE
from rollout_lens.trainer.builders import pretrained

from bench.scale_data import (
    QUANTILE_LEVELS,
    RECORDED_QUANTILES,
    LogprobSampler,
    RealText,
    ScaleRun,
    record_logprobs,
    use_real_text,
)

# The shape of --real-text unless given: a few hundred steps of 16 groups × 8 rollouts × ~512
# tokens (102,400 rollouts would take the two cores an hour; 25,600 take minutes), in a
# vocabulary of SmolLM2's 49,152 ids and the synthetic's structure and control tokens just above
# them, as a tokenizer's added tokens are (at 150,000 they made every completion's ids need more
# than 16 bits).
REAL_SHAPE = {"groups": 16, "tokens": 512, "steps": 200, "vocab": 50_000}
TARGETS = {"SQLite": 2.5, "PostgreSQL": 3.5}  # bytes a rollout ÷ TRL's parquet's


def model_dir() -> str:
    cache = get_settings().model_cache_dir
    assert cache is not None
    if not pretrained.is_ready(cache):
        raise SystemExit(
            f"--real-text needs the real model's tokenizer in {cache}:"
            " rollout-lens build-model --real"
        )
    return str(pretrained.model_dir(cache))


def use_real(run: ScaleRun) -> None:
    """Make `run`'s completions real text and its logprobs the real model's."""
    real = RealText(model_dir())
    use_real_text(run, real, LogprobSampler(QUANTILE_LEVELS, RECORDED_QUANTILES))
    sizes = ", ".join(f"{kind} {len(ids) / 1000:,.0f}k" for kind, ids in real.sources.items())
    print(
        f"  real text: {pretrained.LABEL}'s ids of {sizes} (ids);"
        f" logprobs drawn from {pretrained.LABEL}'s own samples at temperature 1"
        f" ({len(RECORDED_QUANTILES)} recorded quantiles); search words are the synthetic run's"
    )


@dataclass
class Floor:
    """Counts of every id and every logprob code written: their order-0 entropy."""

    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    codes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def add(self, record: StepRecord) -> None:
        self.add_arrays(
            np.concatenate([np.asarray(r.completion_ids) for r in record.rollouts]),
            np.concatenate([np.asarray(r.token_logprobs, float) for r in record.rollouts]),
        )

    def add_arrays(self, ids: np.ndarray, lp: np.ndarray) -> None:
        """Count these ids and these logprobs' codes (the store's steps of 1/LOGPROB_SCALE nat)."""
        codes = np.rint(np.clip(-lp, 0.0, -LOGPROB_FLOOR) * LOGPROB_SCALE).astype(np.int64)
        self.ids = _add(self.ids, np.bincount(ids))
        self.codes = _add(self.codes, np.bincount(codes))

    def bits(self) -> tuple[float, float]:
        """Order-0 entropy of the ids and of the logprob codes, bits a token."""
        return _entropy(self.ids), _entropy(self.codes)


def _add(total: np.ndarray, more: np.ndarray) -> np.ndarray:
    if len(more) > len(total):
        total, more = more, total
    out = total.copy()
    out[: len(more)] += more
    return out


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def print_floor(floor: Floor, rollouts: int, tokens: int, parquet_bytes: int) -> None:
    """The floor beside the databases' bytes: what ids and logprobs cost at order-0 entropy."""
    id_bits, lp_bits = floor.bits()
    per_token = tokens / rollouts
    id_b, lp_b = id_bits * per_token / 8, lp_bits * per_token / 8
    trl = parquet_bytes / rollouts
    print(
        f"  floor (order-0 entropy): ids {id_bits:.2f} bits a token ({id_b / 1000:.2f} KB a"
        f" rollout), logprobs at 1/{LOGPROB_SCALE} nat {lp_bits:.2f} bits ({lp_b / 1000:.2f} KB):"
        f" {(id_b + lp_b) / 1000:.2f} KB a rollout, {(id_b + lp_b) / trl:.2f}× the parquet's"
        f" {trl / 1000:.2f} KB"
    )
    print(
        f"  targets: SQLite ≤ {TARGETS['SQLite']}× the parquet, PostgreSQL ≤ {TARGETS['PostgreSQL']}×"
    )


def print_recorded(tokens: int) -> None:
    """--record-logprobs: the real model's sampled logprobs as the quantile table of
    scale_data.RECORDED_QUANTILES."""
    folder = model_dir()
    values = record_logprobs(folder, RealText(folder), tokens=tokens)
    levels = _levels()
    quantiles = np.quantile(values, levels)
    print(
        f"# {len(values):,} sampled tokens; mean {values.mean():.3f} nat, "
        f"share above -0.01 nat {(values > -0.01).mean():.3f}"
    )
    print(f"QUANTILE_LEVELS = ({', '.join(f'{x:.6g}' for x in levels)})")
    print(f"RECORDED_QUANTILES = ({', '.join(f'{x:.5g}' for x in quantiles)})")


def _levels() -> np.ndarray:
    """Quantile levels: even in the body, finer toward both ends (the near-0 mass and the
    tail)."""
    body = np.linspace(0.02, 0.98, 49)
    ends = np.concatenate([[0.0, 0.001, 0.005, 0.01], [0.99, 0.995, 0.999, 1.0]])
    return np.unique(np.concatenate([body, ends]))
