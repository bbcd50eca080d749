"""The recording wire format: steps as a trainer sends them to a dashboard over HTTP.

A request body is `RLW1` and then one *frame* per step, each a u32 (little-endian) byte length
and a zstd frame (its content size written) holding three Arrow IPC streams, each after its u64
length:

- `step`: one row — step, rollout_step, recorded_at, values and metrics (map<string, float64>);
  its schema metadata names the run's control tokens;
- `rollouts`: one row a rollout — its scalars and texts as columns (prompts dictionary-encoded)
  and its per-token arrays as the store's own blobs (server.store.arrays: ids exact, logprobs in
  1/4096 nat, control-token probabilities sparse), so a step is no larger on the wire than in
  the store and the server stores what it received without quantizing twice (coding a decoded
  blob again gives the same bytes); `text_rule` says when the completion's text is rebuilt from
  its tokens' pieces (then not sent), as the store does; `generator_logprobs` (the generator's
  logprobs, coded as logprobs; null: none given) is its last column, and a body from a sender
  before it (ROLLOUT_SCHEMA_BEFORE_GENERATOR: the same columns but that one) is taken as having
  none;
- `pieces`: the text of each token id the sender has not sent in an earlier step that the
  dashboard took (`id`, `piece`).

Σ logprob travels at full precision (the store keeps it so). The server decodes and checks
everything before it writes (`decode_body`): the frame sizes against the request's limits,
each Arrow stream's schema exactly and its data in full (`RecordBatch.validate(full=True)`),
every number's range, every blob decoded against its rollout's length. A problem is a
WireInvalid naming the field (`steps[2].rollouts[17].logprobs: …`), and nothing is written.

What a request decodes is bounded before it is allocated by a Budget: DECODE_FACTOR × the
request byte cap (ROLLOUT_LENS_RECORD_MAX_MB), taken by each frame's declared size while it is
read and by every text, piece, rollout and token array it decodes into, from the sizes the
Arrow streams declare (a dictionary's prompt counted for every rollout that uses it). Arrow's
own buffer compression is refused unread: the frame is zstd already, and a compressed buffer
says its size only as it is decompressed.
"""

from __future__ import annotations

import io
import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zstandard
from rollout_lens.server.core.distinct import distinct, distinct_inverse
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import ControlProbs, RolloutRecord, StepRecord
from rollout_lens.server.core.textsafe import clip, finite_json, storable
from rollout_lens.server.core.tokentext import TEXT_RULES
from rollout_lens.server.exchange.bounds import (
    DECODE_FACTOR,
    JSON_BYTES,
    MAX_INT32,
    MAX_TOKENS,
    check_depth,
)
from rollout_lens.server.store import arrays

MAGIC = b"RLW1"
CONTENT_TYPE = "application/octet-stream"  # the body starts with MAGIC
WIRE_VERSION = "1"
MAX_REQUEST_TOKENS = 4 * 2**20  # token positions of one request (its arrays are held decoded)
MAX_STEPS = 256  # steps of one request
MAX_NAMES = 2_000  # values and metrics names of one step
MAX_NAME_CHARS = 200
MAX_PIECE_CHARS = 4_096
MAX_STATE_CHARS = 32
MAX_ROLLOUTS = 8_192  # rollouts of one step: 16 × a step of 64 prompts × 8 completions
DEFAULT_MAX_BYTES = 64 * 2**20  # the byte cap when none is given (ROLLOUT_LENS_RECORD_MAX_MB's)
ROLLOUT_BYTES = 2_048  # a rollout's Python objects (its row, its record), less texts and arrays
PIECE_BYTES = 256  # a piece's Python objects, less its text
TOKEN_BYTES = 32  # a token position's arrays: id, logprob, its piece's place twice (8 bytes each)
CONTROL_BYTES = 8  # … and 8 bytes a control token (its probability)
GENERATOR_BYTES = 8  # … and 8 bytes where the generator's logprobs came with it
_LEVEL = 3

STEP_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rollout_step", pa.int64()),
        ("recorded_at", pa.timestamp("us", tz="UTC")),
        ("values", pa.map_(pa.string(), pa.float64())),
        ("metrics", pa.map_(pa.string(), pa.float64())),
    ]
)
ROLLOUT_SCHEMA = pa.schema(
    [
        ("group", pa.int64()),
        ("index", pa.int64()),
        ("prompt", pa.dictionary(pa.int32(), pa.large_string())),
        ("completion", pa.large_string()),  # null: rebuilt from the pieces by text_rule
        ("text_rule", pa.int32()),
        ("n_tokens", pa.int32()),
        ("ids", pa.binary()),
        ("logprobs", pa.binary()),  # null: not measured
        ("control", pa.binary()),  # null: not measured
        ("sum_logprob", pa.float64()),
        ("vote", pa.large_string()),
        ("target", pa.large_string()),
        ("verifier_reward", pa.float64()),
        ("true_score", pa.float64()),
        ("advantage", pa.float64()),
        ("format_valid", pa.bool_()),
        ("format_state", pa.large_string()),
        ("meta", pa.large_string()),  # JSON object text
        ("has_tokens", pa.bool_()),  # its tokens' pieces are known (sent now or before)
        # the generator's logprobs, coded as logprobs; null: the generation path gave none
        ("generator_logprobs", pa.binary()),
    ]
)
# What senders before the generator's logprobs send: the same columns but the last (taken, as
# a body whose rollouts have none).
ROLLOUT_SCHEMA_BEFORE_GENERATOR = ROLLOUT_SCHEMA.remove(
    ROLLOUT_SCHEMA.get_field_index("generator_logprobs")
)
PIECES_SCHEMA = pa.schema([("id", pa.int64()), ("piece", pa.large_string())])


class WireInvalid(InvalidInput):
    """A body the server refuses; `field` names what is at fault."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class Budget:
    """The bytes one request may still hold decoded: taken before each allocation, so a body
    that would decode to more is refused before it does."""

    most: int
    left: int = -1

    def __post_init__(self) -> None:
        if self.left < 0:
            self.left = self.most

    @classmethod
    def of(cls, max_bytes: int = DEFAULT_MAX_BYTES) -> Budget:
        """The budget of a request whose body may be up to `max_bytes`."""
        return cls(DECODE_FACTOR * max_bytes)

    def take(self, n: int, where: str, what: str) -> None:
        if n > self.left:
            raise WireInvalid(
                where,
                f"{what} would decode to {n:,} bytes, more than the {self.left:,} left of the "
                f"{self.most:,} one request may decode ({DECODE_FACTOR} × "
                "ROLLOUT_LENS_RECORD_MAX_MB): send fewer steps a request",
            )
        self.left -= n

    def give(self, n: int) -> None:
        self.left += n


# --- the sender's side ---------------------------------------------------------------------------


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


@dataclass
class Encoded:
    """One step's frame and the token ids whose pieces it carries."""

    frame: bytes
    new_ids: np.ndarray
    tokens: int  # token positions (the request's budget counts them)
    decoded: int = 0  # about what the dashboard's Budget takes for it (a batch keeps within it)


def encode_step(record: StepRecord, control_tokens: Sequence[str], sent: np.ndarray) -> Encoded:
    """A step → its frame; `sent` is the sorted ids whose pieces the dashboard has (or will
    have from a frame before this one)."""
    tokens = list(control_tokens)
    rollouts = record.rollouts
    pieces, rules, has_tokens = _sent_pieces(rollouts)
    ids = np.fromiter(pieces, dtype=np.int64, count=len(pieces))
    new = np.setdiff1d(ids, sent, assume_unique=False) if len(ids) else ids
    table = _rollout_table(rollouts, tokens, rules, has_tokens)
    new_list = new.tolist()
    piece_table = pa.table(
        {"id": new_list, "piece": [pieces[i] for i in new_list]}, schema=PIECES_SCHEMA
    )
    parts = (_step_table(record, tokens), table, piece_table)
    raw = b"".join(struct.pack("<Q", len(part)) + part for part in map(_ipc, parts))
    frame = zstandard.ZstdCompressor(level=_LEVEL, write_content_size=True).compress(raw)
    n_tokens = sum(len(r.completion_ids) for r in rollouts)
    decoded = (
        2 * len(raw)  # the frame, and its step row, pieces and rebuilt texts
        + _rollouts_bytes(table)
        + n_tokens * (TOKEN_BYTES + CONTROL_BYTES * len(tokens))
        + _generator_tokens(table) * GENERATOR_BYTES
        + len(new_list) * PIECE_BYTES
    )
    return Encoded(frame, new, n_tokens, decoded)


def _sent_pieces(
    rollouts: Sequence[RolloutRecord],
) -> tuple[dict[int, str], list[int | None], list[bool]]:
    """The pieces of the rollouts' token ids (id → its text, the first seen), each rollout's
    text rule (None: its completion travels as text) and whether it has every token's piece."""
    pieces: dict[int, str] = {}
    rules: list[int | None] = []
    has_tokens: list[bool] = []
    for r in rollouts:
        given = r.tokens if r.tokens is not None else r.meta.get("tokens")
        texts: list[str] = [str(t) for t in given] if isinstance(given, list) else []
        ok = bool(texts) and len(texts) == len(r.completion_ids)
        has_tokens.append(ok)
        if not ok:
            rules.append(None)
            continue
        rules.append(arrays.pieces_rule(r.completion, texts))
        for token_id, text in zip(r.completion_ids.tolist(), texts, strict=True):
            pieces.setdefault(token_id, text)
    return pieces, rules, has_tokens


def _step_table(record: StepRecord, tokens: list[str]) -> pa.Table:
    return pa.table(
        {
            "step": [record.step],
            "rollout_step": [record.rollout_step],
            "recorded_at": [record.recorded_at or datetime.now(UTC)],
            "values": [list(_finite_items(record.values))],
            "metrics": [list(_finite_items(record.metrics))],
        },
        schema=STEP_SCHEMA.with_metadata(
            {"version": WIRE_VERSION, "control_tokens": json.dumps(tokens)}
        ),
    )


def _rollout_table(
    rollouts: Sequence[RolloutRecord],
    tokens: list[str],
    rules: list[int | None],
    has_tokens: list[bool],
) -> pa.Table:
    """The rollouts' rows: their arrays as the store's blobs (coded for the batch at once)."""
    blobs = arrays.encode_rollouts(
        [r.completion_ids for r in rollouts],
        [r.token_logprobs for r in rollouts],
        [r.control_probs.ordered(tokens) for r in rollouts],
    )
    measured_lp = [bool(len(r.token_logprobs)) or not len(r.completion_ids) for r in rollouts]
    return pa.table(
        {
            "group": [r.group for r in rollouts],
            "index": [r.index for r in rollouts],
            "prompt": pa.array([r.prompt for r in rollouts], pa.large_string()).dictionary_encode(),
            "completion": [
                None if rule is not None else r.completion
                for r, rule in zip(rollouts, rules, strict=True)
            ],
            "text_rule": rules,
            "n_tokens": [len(r.completion_ids) for r in rollouts],
            "ids": [b[0] for b in blobs],
            "logprobs": [b[1] if m else None for b, m in zip(blobs, measured_lp, strict=True)],
            "control": [
                b[2] if r.control_probs.measured else None
                for b, r in zip(blobs, rollouts, strict=True)
            ],
            "sum_logprob": [_sum_logprob(r.sum_logprob) for r in rollouts],
            "vote": [r.vote for r in rollouts],
            "target": [r.target for r in rollouts],
            "verifier_reward": [float(r.verifier_reward) for r in rollouts],
            "true_score": [_finite(r.true_score) for r in rollouts],
            "advantage": [float(r.advantage) for r in rollouts],
            "format_valid": [r.format_valid for r in rollouts],
            "format_state": [r.format_state for r in rollouts],
            "meta": [_meta_text(r.meta) for r in rollouts],
            "has_tokens": has_tokens,
            "generator_logprobs": [_generator_blob(r) for r in rollouts],
        },
        schema=ROLLOUT_SCHEMA,
    )


def _generator_blob(r: RolloutRecord) -> bytes | None:
    """The generator's logprobs as the store codes them (None: none given)."""
    found = r.generator_logprobs
    return None if found is None else arrays.encode_logprobs(found)


def _generator_tokens(table: pa.Table) -> int:
    """Token positions of the rollouts that carry the generator's logprobs (none: an older
    sender's table)."""
    if "generator_logprobs" not in table.schema.names:
        return 0
    given = pc.is_valid(table.column("generator_logprobs"))
    return int(pc.sum(pc.if_else(given, table.column("n_tokens"), 0)).as_py() or 0)


def _finite_items(values: Mapping[str, float | None]) -> Iterable[tuple[str, float | None]]:
    for name, value in values.items():
        number = None if value is None else float(value)
        yield name, number if number is None or math.isfinite(number) else None


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _sum_logprob(value: float | None) -> float | None:
    """As the store keeps it: -inf stays (a token given no mass), NaN and +inf are no sum."""
    return value if value == -math.inf else _finite(value)


def _meta_text(meta: Mapping[str, Any]) -> str | None:
    """A rollout's meta as JSON text: NaN and infinities as null, as the store writes them (the
    server refuses them: JSON has no such numbers)."""
    own = {k: v for k, v in meta.items() if k != "tokens"}
    return finite_json(own, ensure_ascii=False, default=str) if own else None


def body(frames: Iterable[bytes]) -> bytes:
    """The request body of these step frames."""
    return MAGIC + b"".join(struct.pack("<I", len(f)) + f for f in frames)


# --- the server's side ---------------------------------------------------------------------------


@dataclass
class Received:
    """A step as received: its record (rollouts' tokens still to be completed) and pieces."""

    record: StepRecord
    pieces: dict[int, str]
    needs_tokens: list[bool] = field(default_factory=list)  # per rollout: has_tokens
    tokens: int = 0


def decode_body(
    data: bytes,
    *,
    control_tokens: Sequence[str],
    max_tokens: int = MAX_REQUEST_TOKENS,
    budget: Budget | None = None,
) -> list[Received]:
    """A request body → its steps, every field checked (WireInvalid names the one at fault).
    `budget`: what it may decode (Budget.of the request's byte cap; complete_tokens takes the
    rest of it)."""
    if not data.startswith(MAGIC):
        raise WireInvalid("body", f"not a Rollout Lens steps body (it must start with {MAGIC!r})")
    budget = budget if budget is not None else Budget.of()
    at, tokens_left = len(MAGIC), max_tokens
    out: list[Received] = []
    while at < len(data):
        where = f"steps[{len(out)}]"
        if len(out) >= MAX_STEPS:
            raise WireInvalid("steps", f"more than {MAX_STEPS} steps in one request")
        if at + 4 > len(data):
            raise WireInvalid(where, "cut short (its length)")
        (size,) = struct.unpack_from("<I", data, at)
        at += 4
        if at + size > len(data):
            raise WireInvalid(where, f"cut short: {size:,} bytes said, {len(data) - at:,} left")
        received = _decode_frame(
            data[at : at + size],
            where,
            control_tokens=control_tokens,
            budget=tokens_left,
            decoded=budget,
        )
        tokens_left -= received.tokens
        out.append(received)
        at += size
    if not out:
        raise WireInvalid("steps", "no steps in the body")
    return out


def _decode_frame(
    frame: bytes, where: str, *, control_tokens: Sequence[str], budget: int, decoded: Budget
) -> Received:
    # The frame's bytes are held while its tables are read (they are views of them), then
    # given back: what stays is what its step decoded to, taken from `decoded` as it is made.
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        size = -1
    if size < 0:
        raise WireInvalid(where, "a zstd frame that does not say its size")
    decoded.take(size, where, "its zstd frame")
    parts = _frame_parts(frame, size, where)
    step_t = _table(parts[0], STEP_SCHEMA, f"{where}.step")
    rollouts_t = _table(
        parts[1], ROLLOUT_SCHEMA, f"{where}.rollouts", older=ROLLOUT_SCHEMA_BEFORE_GENERATOR
    )
    pieces_t = _table(parts[2], PIECES_SCHEMA, f"{where}.pieces")
    _check_version(step_t, where, control_tokens)
    step = _step_row(step_t, where, decoded, len(parts[0]))
    _take_rollouts(rollouts_t, where, decoded)
    pieces = _pieces(pieces_t, f"{where}.pieces", most=_pieced(rollouts_t), decoded=decoded)
    total = _tokens_within(rollouts_t, where, budget)
    k = len(control_tokens)
    decoded.take(
        total * (TOKEN_BYTES + CONTROL_BYTES * k) + _generator_tokens(rollouts_t) * GENERATOR_BYTES,
        f"{where}.rollouts",
        f"{total:,} tokens",
    )
    seen: set[tuple[int, int]] = set()
    records: list[RolloutRecord] = []
    needs: list[bool] = []
    for i, r in enumerate(rollouts_t.to_pylist()):
        records.append(_rollout(r, f"{where}.rollouts[{i}]", control_tokens, seen))
        needs.append(bool(r["has_tokens"]))
    _check_pieced(pieces_t.num_rows, records, needs, f"{where}.pieces")
    decoded.give(size)  # the frame's bytes: its tables are no longer read
    step.rollouts = records
    return Received(step, pieces, needs, total)


def _check_version(step_t: pa.Table, where: str, control_tokens: Sequence[str]) -> None:
    """The frame's wire version, and control tokens that are the run's."""
    meta = step_t.schema.metadata or {}
    if meta.get(b"version") != WIRE_VERSION.encode():
        raise WireInvalid(f"{where}.step", f"wire version {meta.get(b'version')!r}, not 1")
    try:
        sent_tokens = json.loads(meta.get(b"control_tokens", b"[]"))
    except (ValueError, RecursionError):  # "[[[…" past Python's recursion limit
        raise WireInvalid(f"{where}.control_tokens", "not JSON (or nested too deep)") from None
    if sent_tokens != list(control_tokens):
        raise WireInvalid(
            f"{where}.control_tokens",
            f"{len(sent_tokens) if isinstance(sent_tokens, list) else '?'} tokens that are not "
            "the run's (a run's control tokens are fixed when it is created)",
        )


def _step_row(step_t: pa.Table, where: str, decoded: Budget, size: int) -> StepRecord:
    """The frame's one step row (`size` bytes of the frame), checked; its rollouts come
    apart."""
    if step_t.num_rows != 1:
        raise WireInvalid(f"{where}.step", f"{step_t.num_rows} rows, not 1")
    for name in ("values", "metrics"):  # counted before their names become Python strings
        if sum(len(chunk.keys) for chunk in step_t.column(name).chunks) > MAX_NAMES:
            raise WireInvalid(f"{where}.step.{name}", f"more than {MAX_NAMES} names")
    decoded.take(size, f"{where}.step", "its step row")
    try:
        row = step_t.to_pylist()[0]
    except (ValueError, OverflowError):  # a time past Python's datetime (year 10000, say)
        raise WireInvalid(f"{where}.step.recorded_at", "not a time of this era") from None
    step = _int(row["step"], f"{where}.step.step", low=0)
    rollout_step = _int(row["rollout_step"], f"{where}.step.rollout_step", low=0)
    if rollout_step > step:
        raise WireInvalid(f"{where}.step.rollout_step", "after its step")
    return StepRecord(
        step=step,
        rollout_step=rollout_step,
        values=_series(row["values"], f"{where}.step.values"),
        metrics=_series(row["metrics"], f"{where}.step.metrics"),
        recorded_at=row["recorded_at"],
    )


def _tokens_within(rollouts_t: pa.Table, where: str, budget: int) -> int:
    """The frame's token positions, each rollout's and in all within what the request may
    still hold."""
    total = 0
    for i, n in enumerate(rollouts_t.column("n_tokens").to_pylist()):
        _int(n, f"{where}.rollouts[{i}].n_tokens", low=0, high=MAX_TOKENS)
        total += n
    if total > budget:
        raise WireInvalid(
            f"{where}.rollouts",
            f"{total:,} tokens: more than this request may hold ({MAX_REQUEST_TOKENS:,} in all)",
        )
    return total


def _rollout(
    r: dict[str, Any], w: str, control_tokens: Sequence[str], seen: set[tuple[int, int]]
) -> RolloutRecord:
    """One received rollout row as the write entity, its arrays decoded (checked) in the
    entity's orientation; `seen`: the (group, index) of the frame's rollouts before it."""
    group = _int(r["group"], f"{w}.group", low=0)
    index = _int(r["index"], f"{w}.index", low=0)
    if (group, index) in seen:
        raise WireInvalid(f"{w}.index", f"group {group} has two rollouts #{index}")
    seen.add((group, index))
    n, k = r["n_tokens"], len(control_tokens)
    if r["ids"] is None:
        raise WireInvalid(f"{w}.ids", "missing")
    ids = _blob(f"{w}.ids", partial(arrays.decode_ids_checked, r["ids"], n))
    lp = np.zeros(0)
    if r["logprobs"] is not None:
        lp = _blob(f"{w}.logprobs", partial(arrays.decode_logprobs_checked, r["logprobs"], n))
    control = np.zeros((0, k))
    if r["control"] is not None:
        control = _blob(f"{w}.control", partial(arrays.decode_control_checked, r["control"], k, n))
    generator = None
    if r.get("generator_logprobs") is not None:
        generator = _blob(
            f"{w}.generator_logprobs",
            partial(arrays.decode_logprobs_checked, r["generator_logprobs"], n),
        )
    rule = r["text_rule"]
    _check_values(r, w)
    total = r["sum_logprob"]
    return RolloutRecord(
        group=group,
        index=index,
        prompt=r["prompt"] or "",
        completion=r["completion"] or "",
        completion_ids=ids,
        token_logprobs=lp,
        generator_logprobs=generator,
        control_probs=ControlProbs(list(control_tokens), control),
        vote=r["vote"],
        target=r["target"],
        verifier_reward=r["verifier_reward"],
        true_score=r["true_score"],
        advantage=r["advantage"],
        format_valid=r["format_valid"],
        format_state=r["format_state"],
        meta=_meta(r["meta"], f"{w}.meta") if r["meta"] is not None else {},
        # the sender's Σ, at full precision (its logprobs arrive quantized); null: unknown
        given_sum_logprob=math.nan if total is None else total,
        text_rule=rule,
    )


def _check_values(r: dict[str, Any], w: str) -> None:
    """A received rollout's text rule and numbers: what the store cannot take is refused."""
    rule = r["text_rule"]
    if rule is not None and (rule < 0 or rule % 8 not in TEXT_RULES or rule // 8 > 2):
        raise WireInvalid(f"{w}.text_rule", f"no rule {rule}")
    if rule is not None and not r["has_tokens"]:
        raise WireInvalid(f"{w}.text_rule", "a text rule without the tokens' pieces")
    if rule is None and r["completion"] is None:
        raise WireInvalid(f"{w}.completion", "missing (and no text rule rebuilds it)")
    for name in ("verifier_reward", "advantage"):
        value = r[name]
        if value is None or not math.isfinite(value):
            raise WireInvalid(
                f"{w}.{name}", "missing" if value is None else f"{value}: not a finite number"
            )
    true = r["true_score"]
    if true is not None and not math.isfinite(true):
        raise WireInvalid(f"{w}.true_score", f"{true} (send null for unknown)")
    total_lp = r["sum_logprob"]
    # -inf is a Σ logprob (a token the policy gave no mass: the store keeps it)
    if total_lp is not None and (math.isnan(total_lp) or total_lp == math.inf):
        raise WireInvalid(f"{w}.sum_logprob", f"{total_lp} (send null for unknown)")
    state = r["format_state"]
    if state is not None and len(state) > MAX_STATE_CHARS:
        raise WireInvalid(f"{w}.format_state", f"longer than {MAX_STATE_CHARS} characters")


def _frame_parts(frame: bytes, size: int, where: str) -> list[bytes]:
    """The three streams of a frame of `size` bytes, read one after the other: a length past
    what the frame says it holds is refused before anything more is decompressed."""
    reader = zstandard.ZstdDecompressor().stream_reader(frame)
    parts, at = [], 0
    try:
        for name in ("step", "rollouts", "pieces"):
            if at + 8 > size:
                raise WireInvalid(f"{where}.{name}", "missing")
            (n,) = struct.unpack("<Q", _read(reader, 8, f"{where}.{name}"))
            at += 8
            if n > size - at:
                raise WireInvalid(f"{where}.{name}", "cut short")
            parts.append(_read(reader, n, f"{where}.{name}"))
            at += n
        if at != size or reader.read(1):
            raise WireInvalid(where, "bytes after its three tables")
    except zstandard.ZstdError as exc:
        raise WireInvalid(where, f"not a whole zstd frame ({exc})") from None
    return parts


def _read(reader: Any, n: int, where: str) -> bytes:
    chunks, left = [], n
    while left:
        chunk = reader.read(left)
        if not chunk:
            raise WireInvalid(where, "cut short")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _table(
    data: bytes, schema: pa.Schema, where: str, *, older: pa.Schema | None = None
) -> pa.Table:
    """An Arrow IPC stream of exactly `schema` (or `older`, an earlier sender's), validated in
    full before any value is read."""
    try:
        for message in pa.ipc.MessageReader.open_stream(pa.BufferReader(data)):
            if _compressed(message.metadata.to_pybytes()):
                raise WireInvalid(
                    where,
                    "Arrow buffers compressed in the stream (the frame is zstd already: "
                    "send them uncompressed)",
                )
        reader = pa.ipc.open_stream(pa.BufferReader(data))
        got = reader.schema
        if older is not None and got.remove_metadata().equals(older.remove_metadata()):
            schema = older
        if not got.remove_metadata().equals(schema.remove_metadata()):
            names = {f.name: f.type for f in got}
            for f in schema:
                if f.name not in names:
                    raise WireInvalid(f"{where}.{f.name}", "missing")
                if names[f.name] != f.type:
                    raise WireInvalid(f"{where}.{f.name}", f"of type {names[f.name]}, not {f.type}")
            extra = [n for n in names if n not in schema.names]
            raise WireInvalid(f"{where}.{extra[0] if extra else 'schema'}", "not expected")
        batches = []
        for batch in reader:
            batch.validate(full=True)
            batches.append(batch)
        return pa.Table.from_batches(batches, schema=got)
    except WireInvalid:
        raise
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise WireInvalid(where, f"not a valid Arrow IPC stream ({str(exc)[:200]})") from None


def _compressed(header: bytes) -> bool:
    """Whether an Arrow IPC message's header (a Message flatbuffer, Arrow's format/Message.fbs)
    compresses its body: a RecordBatch's `compression`, or its DictionaryBatch's data's. Read
    before the body, whose compressed buffers say their size only as they are decompressed."""
    try:

        def table(at: int) -> Callable[[int], int | None]:
            vtable = at - struct.unpack_from("<i", header, at)[0]
            (vtable_size,) = struct.unpack_from("<H", header, vtable)

            def field(i: int) -> int | None:  # where field i is, or None if absent
                slot = 4 + 2 * i
                if slot + 2 > vtable_size:
                    return None
                (offset,) = struct.unpack_from("<H", header, vtable + slot)
                return at + offset if offset else None

            return field

        def follow(at: int) -> int:
            (offset,) = struct.unpack_from("<I", header, at)
            return at + int(offset)

        message = table(struct.unpack_from("<I", header, 0)[0])
        kind_at, body_at = message(1), message(2)  # header_type, header
        if kind_at is None or body_at is None:
            return False
        kind, batch = header[kind_at], table(follow(body_at))
        if kind == 2:  # a DictionaryBatch: its `data` is a RecordBatch
            data_at = batch(1)
            if data_at is None:
                return False
            batch = table(follow(data_at))
        elif kind != 3:  # not a RecordBatch: no body to decompress
            return False
        return batch(3) is not None  # RecordBatch.compression
    except (struct.error, IndexError):
        raise ValueError("a message header that does not read") from None


def _meta(text: str, where: str) -> dict[str, Any]:
    """A rollout's meta: a JSON object, nested at most MAX_JSON_DEPTH deep, and no NaN or
    infinity in it (`NaN`, `Infinity` or `1e999`): JSON has no such numbers, and the sender maps
    them to null (a page could not read them back)."""
    unshowable: list[str] = []

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            unshowable.append(literal)
        return value

    try:
        value = json.loads(text, parse_constant=number, parse_float=number)
    except (ValueError, RecursionError):
        raise WireInvalid(where, "not JSON (or nested too deep)") from None
    if not isinstance(value, dict):
        raise WireInvalid(where, "not a JSON object")
    try:
        check_depth(value, where)
    except InvalidInput as exc:
        raise WireInvalid(where, str(exc).split(": ", 1)[-1]) from None
    if unshowable:
        raise WireInvalid(
            _non_finite_at(value, where),
            f"{unshowable[0][:40]}: JSON has no such number (send null, or a finite number)",
        )
    return value


def _non_finite_at(value: Any, where: str) -> str:
    """The path of the first NaN or infinity in a JSON value (`meta.score`, `meta.a[2]`)."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return at
        if isinstance(item, dict):
            stack.extend((v, _key_path(at, k)) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in reversed(list(enumerate(item))))
    return where


def _key_path(at: str, key: str) -> str:
    """`at.key` for a plain name, else `at["key"]` (ASCII: a key's text is anyone's)."""
    if key.isidentifier() and key.isascii():
        return f"{at}.{key}"
    return f"{at}[{clip(json.dumps(key), 80)}]"


def _int(value: Any, where: str, *, low: int, high: int = MAX_INT32) -> int:
    if value is None or not (low <= value <= high):
        raise WireInvalid(where, f"{value!r} is not a whole number from {low} to {high:,}")
    return int(value)


def _series(items: Any, where: str) -> dict[str, float | None]:
    items = items or []
    if len(items) > MAX_NAMES:
        raise WireInvalid(where, f"more than {MAX_NAMES} names")
    out: dict[str, float | None] = {}
    for name, value in items:
        if name is None or not name or len(name) > MAX_NAME_CHARS:
            raise WireInvalid(where, f"a name that is empty or over {MAX_NAME_CHARS} characters")
        if name in out:
            raise WireInvalid(where, f"{name[:80]!r} twice")
        out[name] = None if value is None or not math.isfinite(value) else value
    return out


def _value_bytes(column: pa.ChunkedArray) -> int:
    """The bytes of a string or binary column's values, a dictionary's value counted for each
    row that uses it (as Python will hold them: one string a row)."""
    total = 0
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            lengths = pc.take(pc.binary_length(chunk.dictionary), chunk.indices)
        else:
            lengths = pc.binary_length(chunk)
        total += pc.sum(lengths).as_py() or 0
    return int(total)


def _rollouts_bytes(table: pa.Table) -> int:
    """What a step's rollout rows decode to: their objects, texts and blobs."""
    size: int = table.num_rows * ROLLOUT_BYTES
    for f in table.schema:
        if f.name == "meta":
            size += JSON_BYTES * _value_bytes(table.column(f.name))
        elif pa.types.is_dictionary(f.type) or f.type in (pa.large_string(), pa.binary()):
            size += _value_bytes(table.column(f.name))
    return size


def _take_rollouts(table: pa.Table, where: str, decoded: Budget) -> None:
    """Refuse a step of more than MAX_ROLLOUTS rollouts, and take what its rows will decode to
    before any is read."""
    n = table.num_rows
    if n > MAX_ROLLOUTS:
        raise WireInvalid(
            f"{where}.rollouts", f"{n:,} rollouts: more than the {MAX_ROLLOUTS:,} a step may hold"
        )
    decoded.take(_rollouts_bytes(table), f"{where}.rollouts", f"{n:,} rollouts")


def _pieced(table: pa.Table) -> int:
    """Token positions of the rollouts sent with their pieces: at most as many pieces."""
    n_tokens = pc.if_else(table.column("has_tokens"), table.column("n_tokens"), 0)
    return max(int(pc.sum(n_tokens).as_py() or 0), 0)


def _check_pieced(
    n_pieces: int, records: Sequence[RolloutRecord], needs: list[bool], where: str
) -> None:
    """A step's pieces are of its own rollouts' token ids: no more than there are distinct."""
    if not n_pieces:
        return
    ids = [r.completion_ids for r, wanted in zip(records, needs, strict=True) if wanted]
    found = len(distinct(np.concatenate(ids))) if ids else 0
    if n_pieces > found:
        raise WireInvalid(
            where,
            f"{n_pieces:,} pieces for the {found:,} token ids of its rollouts sent with "
            "their pieces",
        )


def _pieces(table: pa.Table, where: str, *, most: int, decoded: Budget) -> dict[int, str]:
    if table.num_rows > most:
        raise WireInvalid(
            where,
            f"{table.num_rows:,} pieces for the {most:,} token positions of its rollouts sent "
            "with their pieces",
        )
    decoded.take(
        table.num_rows * PIECE_BYTES + _value_bytes(table.column("piece")),
        where,
        f"{table.num_rows:,} pieces",
    )
    ids = table.column("id").to_pylist()
    texts = table.column("piece").to_pylist()
    out: dict[int, str] = {}
    for i, (token_id, text) in enumerate(zip(ids, texts, strict=True)):
        _int(token_id, f"{where}[{i}].id", low=0)
        if text is None or len(text) > MAX_PIECE_CHARS:
            raise WireInvalid(f"{where}[{i}].piece", "missing or too long")
        out.setdefault(token_id, storable(text))
    return out


def _blob(where: str, decode: Callable[[], np.ndarray]) -> np.ndarray:
    try:
        return decode()
    except ValueError as exc:
        raise WireInvalid(where, str(exc).split(": ", 1)[-1]) from None


def _piece_table(
    distinct: list[int], texts: dict[int, str], known: Callable[[Sequence[int]], Mapping[int, str]]
) -> tuple[np.ndarray, int | None]:
    """Each distinct id's piece (sent in this body, else `known` to the run; None: neither),
    and the first id with none."""
    missing = [i for i in distinct if i not in texts]
    if missing:
        for token_id, text in known(missing).items():
            texts.setdefault(token_id, text)
    table = np.empty(len(distinct), dtype=object)
    absent: int | None = None
    for k, token_id in enumerate(distinct):
        piece = texts.get(token_id)
        if piece is None and absent is None:
            absent = token_id
        table[k] = piece
    return table, absent


def complete_tokens(
    received: Sequence[Received],
    known: Callable[[Sequence[int]], Mapping[int, str]],
    *,
    budget: Budget | None = None,
) -> None:
    """Give each rollout sent with its tokens' pieces its `tokens` (the pieces of its ids: sent
    in this body, or `known` to the run) and its completion text when a text rule rebuilds it
    (its characters taken from `budget`, decode_body's, first). WireInvalid names a rollout
    whose id has no piece anywhere."""
    budget = budget if budget is not None else Budget.of()
    texts: dict[int, str] = {}
    for step in received:
        for token_id, text in step.pieces.items():
            texts.setdefault(token_id, text)
    chosen = [
        (s, i, r)
        for s, step in enumerate(received)
        for i, (r, needs) in enumerate(zip(step.record.rollouts, step.needs_tokens, strict=True))
        if needs
    ]
    if not chosen:
        return
    every = np.concatenate([r.completion_ids for _, _, r in chosen])
    ids, inverse = distinct_inverse(every)
    table, absent = _piece_table(ids.tolist(), texts, known)
    pieces_all = table[inverse]
    chars = np.fromiter((0 if p is None else len(p) for p in table), np.int64, len(table))
    at = 0
    for s, i, r in chosen:
        n = len(r.completion_ids)
        pieces: list[str] = pieces_all[at : at + n].tolist()
        at += n
        if absent is not None and any(p is None for p in pieces):
            raise WireInvalid(
                f"steps[{s}].rollouts[{i}].ids",
                "a token id with no piece (sent neither now nor before)",
            )
        r.set_storable_tokens(pieces)
        rule = r.text_rule
        if rule is not None:
            # a piece of 4,096 characters repeated a million times is a 4 GB text
            size = int(chars[inverse[at - n : at]].sum())
            budget.take(
                size, f"steps[{s}].rollouts[{i}].text_rule", "its text rebuilt from its pieces"
            )
            try:
                r.completion = arrays.rebuild_from_pieces(rule, pieces)
            except (ValueError, UnicodeError):
                raise WireInvalid(
                    f"steps[{s}].rollouts[{i}].text_rule", "does not rebuild a text"
                ) from None
