"""Tool-calling rollouts turn by turn: stitch the per-turn generation probes, read the turns.

TRL's tool loop (`GRPOTrainer._tool_call_loop`, trl 1.x) builds each rollout's completion ids by
concatenation: the first model turn, then for every tool iteration the tool-result suffix (the
chat template's tool message, `tool_mask` 0) and the next model turn (`tool_mask` 1). Generation
runs as one `_generate_single_turn` call for the first turn of every row, then one call per
iteration on the rows that called a tool and whose results fit (`idxs_with_tool`, in row order,
`num_generations=1`). So a row with n tool-result stretches took part in calls 0..n, and call t
holds, in row order, exactly the rows with at least t stretches: that is how each call's probe
rows are matched back to their rows and positions (`stitch`).

Tool-result positions have no logprob (they are not sampled, not trained): they hold 0.0 in the
per-token arrays, as TRL's own logprobs do, so Σ logprob covers model tokens only (NaN in the
generator's logprobs: no value, `stitch_sampled`); `turns` in the rollout's meta says which
positions are which.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from rollout_lens.server.core import vocab
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.core.vocab import TurnState
from rollout_lens.trainer.recorder import structure

if TYPE_CHECKING:
    from rollout_lens.trainer.recorder.probe import GenerationProbe, SamplingProbe

MAX_TEXT = 2000  # characters kept of a tool result or a call's arguments


def runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


def model_spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of the model turn each generation call produced for this row: the first
    turn, then the turn after each tool-result stretch (empty when cut by the length limit)."""
    spans = [(0, 0)]
    for value, start, end in runs(mask):
        if value == 1:
            if spans[-1][1] == start:
                spans[-1] = (spans[-1][0], end)
        else:
            spans.append((end, end))
    return spans


def stitch(
    calls: Sequence[tuple[GenerationProbe, list[list[int]]]],
    ids_list: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    n_control: int,
) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """Per row: logprobs [T] and control-token probabilities [T × n_control] over the whole
    completion (float64 arrays), model turns read from their call's probe, tool results 0.0.
    None when the calls do not line up."""
    read = [probe.finish(returned) if probe.used else None for probe, returned in calls]
    returned = [ids for _, ids in calls]
    logprobs = _place(
        [r[0] if r else None for r in read], returned, ids_list, masks, lambda n: np.zeros(n)
    )
    control = _place(
        [r[1] if r else None for r in read],
        returned,
        ids_list,
        masks,
        lambda n: np.zeros((n, n_control)),
    )
    return None if logprobs is None or control is None else (logprobs, control)


def stitch_sampled(
    calls: Sequence[tuple[SamplingProbe, list[list[int]]]],
    ids_list: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
) -> list[np.ndarray] | None:
    """Per row: the generator's logprobs [T] over the whole completion, model turns read from
    their call's sampling probe, NaN on tool results (not sampled) and where a call was not
    read. None when the calls do not line up."""
    read = [probe.sampled(returned) if probe.used else None for probe, returned in calls]
    returned = [ids for _, ids in calls]
    return _place(read, returned, ids_list, masks, lambda n: np.full(n, np.nan))


def _place(
    read: Sequence[Sequence[np.ndarray] | None],
    returned: Sequence[list[list[int]]],
    ids_list: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    blank: Callable[[int], np.ndarray],
) -> list[np.ndarray] | None:
    """Each call's per-row arrays (None: the call was not read) placed at its model turn of
    each row, over arrays `blank(T)`; None when the calls do not line up."""
    out = [blank(len(ids)) for ids in ids_list]
    spans = [model_spans(mask) for mask in masks]
    if len(returned) < max((len(s) for s in spans), default=0):
        return None
    for t, (arrays, ids_of_call) in enumerate(zip(read, returned, strict=True)):
        members = [i for i, s in enumerate(spans) if len(s) > t]
        if len(members) != len(ids_of_call):
            return None
        for j, i in enumerate(members):
            a, b = spans[i][t]
            n = b - a  # TRL may cut a later turn to the completion budget: a prefix of it
            if n > len(ids_of_call[j]) or list(ids_list[i][a:b]) != ids_of_call[j][:n]:
                return None
            if arrays is not None:
                count = min(n, len(arrays[j]))
                out[i][a : a + count] = arrays[j][:count]
    return out


def model_positions(meta: Mapping[str, Any], n: int) -> np.ndarray | None:
    """Per completion position, whether the model sampled it (None: no turns recorded): a
    boolean mask, a slice a model turn."""
    turns = meta.get("turns")
    if not isinstance(turns, list):
        return None
    sampled = np.zeros(n, dtype=bool)
    for turn in turns:
        if turn.get("role") == "model":
            sampled[max(0, int(turn["start"])) : max(0, min(n, int(turn["end"])))] = True
    return sampled


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def _plain(value: Any) -> Any:
    """JSON-safe arguments (whatever the parser made of them), cut when long."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = json.dumps(str(value))
    return json.loads(text) if len(text) <= MAX_TEXT else _cut(text)


def _function(call: Any) -> Mapping[str, Any]:
    """The function part of a parsed tool call (`{"type", "function": {name, arguments}}` or
    the function itself)."""
    function = call.get("function", call) if isinstance(call, Mapping) else {}
    return function if isinstance(function, Mapping) else {}


def call_name(call: Any) -> str:
    """The name of the tool a parsed call calls ("" when it names none)."""
    return str(_function(call).get("name", ""))


def _call(call: Any) -> dict[str, Any]:
    return {"name": call_name(call), "arguments": _plain(_function(call).get("arguments"))}


def read_turns(mask: Sequence[int], messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The turns of one rollout: `{"role": "model", "start", "end", "calls": [{name,
    arguments}]}` for each model turn and `{"role": "tool", "start", "end", "calls": [{name,
    arguments, result}]}` for each tool-result stretch, spans indexing completion_ids.

    `messages` are the completion's messages as TRL hands them to reward functions: an
    assistant message per model turn (a turn cut to nothing has none), each followed by the
    tool messages of the calls that ran."""
    assistants: list[Mapping[str, Any]] = []
    results: list[list[Mapping[str, Any]]] = []  # tool messages after each assistant message
    for message in messages:
        if message.get("role") == "assistant":
            assistants.append(message)
            results.append([])
        elif message.get("role") == "tool" and results:
            results[-1].append(message)
    turns: list[dict[str, Any]] = []
    spans = model_spans(mask)
    stretches = [(a, b) for value, a, b in runs(mask) if value == 0]
    for k, (a, b) in enumerate(spans):
        said = assistants[k] if k < len(assistants) else {}
        calls = [_call(c) for c in said.get("tool_calls") or []]
        if b > a or said:
            turns.append({"role": "model", "start": a, "end": b, "calls": calls})
        if k < len(stretches):
            answered = results[k] if k < len(results) else []
            ran = []
            for j, message in enumerate(answered):
                name = str(message.get("name", ""))
                arguments = calls[j]["arguments"] if j < len(calls) else None
                ran.append(
                    {
                        "name": name,
                        "arguments": arguments,
                        "result": _cut(content_text(message["content"])),
                    }
                )
            start, end = stretches[k]
            turns.append({"role": "tool", "start": start, "end": end, "calls": ran})
    return turns


def first_call(turns: Sequence[Mapping[str, Any]]) -> str | None:
    """The name of the first tool the rollout called (its vote), if any."""
    for turn in turns:
        if turn["role"] == "model" and turn["calls"]:
            return str(turn["calls"][0]["name"])
    return None


def final_answer(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The last assistant message's text when it calls no tool (the rollout's answer)."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if not assistants or assistants[-1].get("tool_calls"):
        return None
    return _cut(content_text(assistants[-1].get("content")))


def turn_state(
    text: str, calls: int, tags: tuple[str, str], end_tokens: Sequence[str]
) -> TurnState:
    """The structure of one model turn (its decoded text, special tokens kept) that TRL parsed
    `calls` tool calls from, with the chat template's call tags and end-of-turn tokens
    (structure.read_tags: one scan, whether a tag is one token or several)."""
    return reading_state(structure.read_tags(text, tags, end_tokens), calls)


def reading_state(found: structure.TagReading, calls: int) -> TurnState:
    """turn_state of a turn whose tags were read already (`found`)."""
    if found.tags == 0:
        return TurnState.no_call
    if found.eot_in_call:
        return TurnState.eot_in_call
    if found.left_open:
        return TurnState.open_call
    if found.only_calls and len(found.calls) == calls:
        return TurnState.healthy_call
    return TurnState.text_pollution


def turn_states(
    turns: Sequence[Mapping[str, Any]],
    decode: Callable[[int, int], str],
    tags: tuple[str, str],
    end_tokens: Sequence[str],
) -> list[str]:
    """The state of each model turn of a rollout (`decode(start, end)`: the text of a span)."""
    return [
        turn_state(decode(int(t["start"]), int(t["end"])), len(t["calls"]), tags, end_tokens).value
        for t in turns
        if t["role"] == "model"
    ]


def completion_state(text: str, tags: tuple[str, str], end_tokens: Sequence[str]) -> str:
    """A single-turn completion's structural state (a vocab.FormatState) read with its call
    tags (`text` decoded with its special tokens): nothing said is a collapse, else its one
    model turn's state, every closed call counting as a call. A completion the length limit cut
    is a collapse only when the cut fell inside a call (docs/recording/trl.md, the table of
    states)."""
    found = structure.read_tags(text, tags, end_tokens)
    if not found.outside.strip() and found.tags == 0:
        return vocab.FormatState.collapse.value
    return rollout_state([reading_state(found, len(found.calls))])  # the text read once


def rollout_state(states: Sequence[str]) -> str:
    """A tool-calling rollout's structural state (a vocab.FormatState) from its turns' states:
    collapse when any call broke (left open, or end-of-turn inside it), else text pollution when
    any turn has stray text, else a healthy call when it called, else no call."""
    if TurnState.eot_in_call in states or TurnState.open_call in states:
        return vocab.FormatState.collapse.value
    if TurnState.text_pollution in states:
        return vocab.FormatState.text_pollution.value
    if TurnState.healthy_call in states:
        return vocab.FormatState.healthy_call.value
    return vocab.FormatState.no_call.value


def tool_use(turns: Sequence[Mapping[str, Any]], needed: Collection[str] | None) -> dict[str, Any]:
    """Calls, model turns, and (when the episode's needed tools are known) calls to a needed
    tool, of one rollout from its recorded turns."""
    names = [str(c["name"]) for t in turns if t["role"] == "model" for c in t["calls"]]
    out: dict[str, Any] = {
        "calls": len(names),
        "turns": sum(t["role"] == "model" for t in turns),
    }
    if needed is not None:
        out["right_calls"] = sum(name in needed for name in names)
    return out


def step_series(rollouts: Sequence[RolloutRecord]) -> dict[str, float | None]:
    """A step's tool-use series from its tool-calling rollouts' turns (none when it has none):
    calls and model turns per rollout, the share of calls to a needed tool (the row's `needed`,
    else the rollout's target), and the share of model turns at each position in each state."""
    used = []
    states: dict[str, list[str]] = {p: [] for p in vocab.TURN_POSITIONS}
    for r in rollouts:
        recorded = r.meta.get("turns")
        if not isinstance(recorded, list):
            continue
        row = r.meta.get("row")
        needed = (row.get("needed") if isinstance(row, Mapping) else None) or (
            [r.target] if r.target else None
        )
        used.append(tool_use(recorded, needed))
        for i, state in enumerate(r.meta.get("turn_states") or []):
            states[vocab.turn_position(i)].append(state)
    if not used:
        return {}
    n = len(used)
    calls = sum(u["calls"] for u in used)
    right = [u["right_calls"] for u in used if "right_calls" in u]
    out: dict[str, float | None] = {
        vocab.TOOL_CALLS: calls / n,
        vocab.TOOL_TURNS: sum(u["turns"] for u in used) / n,
    }
    if right:
        out[vocab.RIGHT_TOOL_RATE] = sum(right) / calls if calls else None
    for position, seen in states.items():
        if seen:
            for state in vocab.TURN_STATES:
                out[vocab.turn_state(position, state)] = seen.count(state) / len(seen)
    return out
