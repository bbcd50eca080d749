"""Build the offline multi-turn model: a tiny Llama that calls tools in Qwen's JSON format.

A sibling of `tiny_model` (whose model stays as it is, under its own cache key): the same
architecture and initialisation, but its own tokenizer, a chat template with tool calls and tool
results, a response template so transformers/TRL parse its calls, and a format warm-up on whole
conversations, so that it

- opens a turn with `<tool_call>{"name": "ID", "arguments": {}}</tool_call></assistant>`, naming a
  listed tool at random (never the right one on purpose: it starts at chance);
- after a `result: V` observation answers `<answer>V</answer></assistant>` (copying V);
- after a ticket or an error calls again.

Which tool is right is what GRPO has to learn. The model folder is self-contained: the chat
template and `response_template` are saved with the tokenizer, so TRL's GRPOTrainer drives it
through its own tool path with nothing model-specific in the calling code.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_lens.trainer.builders import tiny_model
from rollout_lens.trainer.envs import multistep as ms
from rollout_lens.trainer.envs import onestep as esc

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MODEL_NAME = "tiny-multiturn"
BUILD_STATS_FILE = tiny_model.BUILD_STATS_FILE
# Opening tag, closing tag, end of turn: what the recorder will watch at turn boundaries.
CONTROL_TOKENS = ("<tool_call>", "</tool_call>", "</assistant>")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- elif message['content'] is none or message['content'] is not defined -%}{%- set text = '' -%}"
    "{%- else -%}{%- set text = message['content'] | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}<user>"
    "{%- if loop.first and tools -%}Tools:"
    "{%- for tool in tools -%}"
    "{%- set f = tool['function'] if tool['function'] is defined else tool -%}"
    "{{ '\n- ' }}{{ f['name'] }}: {{ f['description'] }}"
    "{%- endfor -%}{{ '\n' }}"
    "{%- endif -%}{{ text }}</user>"
    "{%- elif message['role'] == 'assistant' -%}<assistant>{{ text }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "<tool_call>{{ '{\"name\": \"' ~ f['name'] ~ '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string -%}{{ f['arguments'] }}"
    "{%- else -%}{{ (f['arguments'] if f['arguments'] is defined else {}) | tojson }}"
    "{%- endif -%}}</tool_call>"
    "{%- endfor -%}</assistant>"
    "{%- elif message['role'] == 'tool' -%}<tool_response>{{ text }}</tool_response>"
    "{%- else -%}{{ raise_exception('the tiny model has no ' ~ message['role'] ~ ' role') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)

# transformers' response parser (>= 5.13), the new-style counterpart of TRL's `qwen3_template`:
# JSON tool calls between <tool_call> tags, text content up to the end of the turn.
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"</assistant>\s*", "content": "text"},
    },
}

# Pieces: tags and the JSON call's fixed parts whole, tool ids whole, numbers without a leading
# space (so `result: 48` and `<answer>48</answer>` share the token 48), words with theirs,
# punctuation and whitespace one character each (decode, a plain Fuse, reproduces any text).
_SPLIT_PATTERN = (
    r'\n- |\{"name": "|", "arguments": |\{\}\}|tool_\d{2}|\d+'
    r"| ?(?!tool_\d)[^\W_\d][^\W_]*|[^\w\s]|\s"
)
_EOS = tiny_model.EOS_TOKEN  # end of turn, as in the single-turn model
# Turn markers and tags: single tokens, not special (a stray one stays visible in decoded text).
_TAG_TOKENS = (
    "<user>",
    "</user>",
    "<assistant>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<answer>",
    "</answer>",
)
_TOKENIZER_SEEDS = range(8)


@dataclass(frozen=True)
class MultiturnRecipe(tiny_model.TinyRecipe):
    """tiny_model's recipe (architecture, init, curriculum of listing sizes, learning rate) with
    the conversation warm-up's own fields; its hash names the cache directory."""

    steps: int = 800
    value_type_init: float = 1.0
    max_calls: int = ms.DEFAULT_MAX_CALLS
    # What a warm-up conversation's tool returns after each call.
    result_share: float = 0.45
    ticket_share: float = 0.2
    eval_prompts: int = 96


RECIPE = MultiturnRecipe()


# This module, the envs whose text it learns, and the single-turn builder it borrows from.
RECIPE_HASH = tiny_model.recipe_hash(
    RECIPE, (Path(__file__), Path(ms.__file__), Path(esc.__file__), Path(tiny_model.__file__))
)


def model_dir(cache_dir: Path) -> Path:
    """Where the multi-turn model for the current recipe lives under `cache_dir`."""
    return Path(cache_dir) / f"{MODEL_NAME}-{RECIPE_HASH}"


def build_multiturn_model(out_dir: Path, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train tokenizer and warm-up into `out_dir`; return the build stats."""
    return tiny_model.build_model(
        out_dir,
        "multi-turn model",
        RECIPE,
        RECIPE_HASH,
        tokenizer=build_tokenizer,
        new_model=_new_model,
        warm_up=_warm_up,
        evaluate=lambda model, tokenizer, variant: evaluate_format(
            model, tokenizer, variant=variant, n=RECIPE.eval_prompts
        ),
        log=log,
    )


def _new_model(tokenizer: PreTrainedTokenizerBase, recipe: MultiturnRecipe) -> PreTrainedModel:
    """tiny_model's Llama (ids initialised for copying), plus a direction all values share, so
    attention finds "the value in the last result" as it finds "the listed ids"."""
    import torch

    model = tiny_model.fresh_model(tokenizer, recipe)
    values = tokenizer.convert_tokens_to_ids([str(v) for v in range(*ms.VALUE_RANGE)])
    with torch.no_grad():
        shared = torch.randn(recipe.hidden_size) * recipe.init_std * recipe.value_type_init
        model.get_input_embeddings().weight[values] += shared
    return model


# -- tokenizer ----------------------------------------------------------------------------------------


def render_call(tool_id: str) -> str:
    """An assistant turn that calls `tool_id`, as the chat template renders it (end of turn too)."""
    return f'<tool_call>{{"name": "{tool_id}", "arguments": {{}}}}</tool_call>{_EOS}'


def render_answer(value: str) -> str:
    return f"<answer>{value}</answer>{_EOS}"


def render_observation(text: str) -> str:
    """A tool result and the next turn's opening, as TRL appends them after a call."""
    return f"<tool_response>{text}</tool_response><assistant>"


def build_tokenizer() -> PreTrainedTokenizerBase:
    """A BPE tokenizer that keeps every word, id, value and tag of the env whole."""
    texts = [t for seed in _TOKENIZER_SEEDS for t in ms.corpus(ms.MultiStepEnv(seed=seed))]
    texts += [render_call(f"tool_{i:02d}") for i in range(esc.TOOL_COUNT)]
    tokenizer = tiny_model.train_tokenizer(texts, _SPLIT_PATTERN, _TAG_TOKENS, CHAT_TEMPLATE)
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


# -- warm-up ------------------------------------------------------------------------------------------


@dataclass
class _Conversation:
    """One warm-up example as token ids, with what each position should predict."""

    ids: list[int]
    hard: list[tuple[int, int]]  # (position of the predicted token, token id)
    soft: list[int]  # positions of tool ids: target uniform over the listed ids
    listed: list[int]  # listed tool ids' token ids


class _Pieces:
    """Token ids of the fixed pieces a conversation is made of (encoded once)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}

    def ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.tokenizer.backend_tokenizer.encode(
                text, add_special_tokens=False
            ).ids
        return self._cache[text]


def _observation(
    rng: random.Random, recipe: MultiturnRecipe, tool_id: str, queries: Sequence[str]
) -> tuple[str, str]:
    """(kind, text) of what a warm-up tool returns."""
    roll = rng.random()
    if roll < recipe.result_share:
        return "result", f"result: {rng.randrange(*ms.VALUE_RANGE)}"
    if roll < recipe.result_share + recipe.ticket_share:
        return "ticket", ms.ticket_text(rng.choice(queries))
    if rng.random() < 0.8:
        return "error", ms.error_text(f"{tool_id} cannot serve this request")
    return "error", ms.error_text(f"Tool {tool_id} not found.")


def _conversation(
    rng: random.Random,
    pieces: _Pieces,
    prompt_ids: list[int],
    listed: list[str],
    recipe: MultiturnRecipe,
    queries: Sequence[str],
) -> _Conversation:
    ids = list(prompt_ids)
    hard: list[tuple[int, int]] = []
    soft: list[int] = []
    listed_tokens = pieces.tokenizer.convert_tokens_to_ids(listed)
    for call in range(recipe.max_calls):
        tool_id = rng.choice(listed)
        turn = pieces.ids(render_call(tool_id))
        for offset, token in enumerate(turn):
            if offset == 2:  # <tool_call> {"name": " ID ...: the id is the third token
                soft.append(len(ids))
            else:
                hard.append((len(ids), token))
            ids.append(token)
        kind, text = _observation(rng, recipe, tool_id, queries)
        ids += pieces.ids(render_observation(text))
        if kind == "result":
            for token in pieces.ids(render_answer(text.removeprefix("result: "))):
                hard.append((len(ids), token))
                ids.append(token)
            break
        if call == recipe.max_calls - 1:
            break  # TRL stops executing calls here; the turn after is left unsupervised
    return _Conversation(ids, hard, soft, listed_tokens)


def _warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    recipe: MultiturnRecipe,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Supervised warm-up on whole conversations: the call format (naming listed tools at
    random), answering from a result, calling again after a ticket or an error."""
    import torch

    rng = random.Random(recipe.seed)
    env = ms.MultiStepEnv()
    queries = [q.text for q in env.train_queries + env.heldout_queries]
    pieces = _Pieces(tokenizer)
    if tokenizer.convert_ids_to_tokens(pieces.ids(render_call("tool_00")))[2] != "tool_00":
        raise RuntimeError("a call did not tokenize with its tool id as the third token")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: tiny_model.lr_factor(s, recipe)
    )
    model.train()
    progress = tiny_model.WarmUp(recipe, log)
    for step in range(1, recipe.steps + 1):
        rows = _warm_up_batch(rng, pieces, recipe, queries, step)
        loss, mass = _warm_up_loss(model, rows, pad=tokenizer.pad_token_id, vocab=len(tokenizer))
        progress.step(step, loss, mass, model, optimizer, schedule)
    return progress.stats()


def _warm_up_batch(
    rng: random.Random,
    pieces: _Pieces,
    recipe: MultiturnRecipe,
    queries: Sequence[str],
    step: int,
) -> list[_Conversation]:
    """A warm-up step's conversations, each on a prompt listing tools at random (their ids and
    capabilities drawn anew) for a user query."""
    tokenizer = pieces.tokenizer
    user_queries = [*queries, ms.CHAIN_QUERY]
    n_tools = tiny_model.listing_size(rng, step, recipe)
    # Sized on the prompt as in tiny_model (a conversation adds ~30-90 tokens per row): fewer,
    # longer-tokened rows per step learnt the listed ids slower for the same time.
    batch = max(1, recipe.tokens_per_step // (60 + 9 * n_tools))
    prompts: list[str] = []
    listings: list[list[str]] = []
    for _ in range(batch):
        ids = sorted(rng.sample(range(esc.TOOL_COUNT), n_tools))
        caps = rng.sample(esc.CAPABILITIES, n_tools)
        names = [f"tool_{i:02d}" for i in ids]
        tools = [
            {"type": "function", "function": {"name": name, "description": cap}}
            for name, cap in zip(names, caps, strict=True)
        ]
        chat = [{"role": "user", "content": ms.render_user(rng.choice(user_queries))}]
        prompts.append(
            tokenizer.apply_chat_template(
                chat, tools=tools, add_generation_prompt=True, tokenize=False
            )
        )
        listings.append(names)
    encoded = tokenizer.backend_tokenizer.encode_batch(prompts, add_special_tokens=False)
    return [
        _conversation(rng, pieces, e.ids, listed, recipe, queries)
        for e, listed in zip(encoded, listings, strict=True)
    ]


def _warm_up_loss(
    model: PreTrainedModel, rows: Sequence[_Conversation], *, pad: int, vocab: int
) -> tuple[Any, float]:
    """The batch's loss (cross-entropy on the fixed tokens, and towards uniform over the listed
    ids at each tool id) per conversation, and the probability mass on the listed ids."""
    import torch

    width = max(len(r.ids) for r in rows)
    input_ids = torch.tensor([r.ids + [pad] * (width - len(r.ids)) for r in rows])
    hidden = model.model(input_ids=input_ids).last_hidden_state
    # Project only the supervised positions (each predicted from the position before it).
    hard_rows = [i for i, r in enumerate(rows) for _ in r.hard]
    hard_pos = [p - 1 for r in rows for p, _ in r.hard]
    hard_tok = torch.tensor([t for r in rows for _, t in r.hard])
    soft_rows = [i for i, r in enumerate(rows) for _ in r.soft]
    soft_pos = [p - 1 for r in rows for p in r.soft]
    logp_hard = model.lm_head(hidden[hard_rows, hard_pos]).log_softmax(-1)
    logp_soft = model.lm_head(hidden[soft_rows, soft_pos]).log_softmax(-1)
    soft_target = torch.zeros(len(soft_rows), vocab)
    k = 0
    for r in rows:
        for _ in r.soft:
            soft_target[k, r.listed] = 1.0 / len(r.listed)
            k += 1
    hard_loss = -logp_hard.gather(1, hard_tok[:, None]).sum()
    soft_loss = -(logp_soft * soft_target).sum()
    loss = (hard_loss + soft_loss) / len(rows)
    with torch.no_grad():
        mass = (logp_soft.exp() * (soft_target > 0)).sum(-1).mean().item()
    return loss, mass


# -- sampling conversations without TRL (evaluation) --------------------------------------------------


def tool_schemas(env: ms.MultiStepEnv, tool_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The JSON schemas TRL renders for an episode's tools (what `get_json_schema` makes of them)."""
    from transformers.utils import get_json_schema

    box = ms.toolbox_class(env, tool_ids)()
    return [get_json_schema(getattr(box, t)) for t in sorted(tool_ids)]


def suffix_ids(tokenizer: PreTrainedTokenizerBase, name: str, content: str) -> list[int]:
    """Token ids TRL appends after a call: the tool message and the next generation prompt
    (the same construction as GRPOTrainer._get_tool_suffix_ids)."""
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    dummy = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": call},
    ]
    prefix = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        [*dummy, {"role": "tool", "name": name, "content": content}],
        tokenize=True,
        return_dict=False,
        add_generation_prompt=True,
    )
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    assert full[: len(prefix)] == prefix, "the chat template must preserve prefixes"
    return full[len(prefix) :]


def sample_conversations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    env: ms.MultiStepEnv | Sequence[ms.MultiStepEnv],
    episodes: Sequence[ms.Episode],
    *,
    max_calls: int = ms.DEFAULT_MAX_CALLS,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    first_calls: Sequence[str | None] | None = None,
) -> list[list[dict[str, Any]]]:
    """Play each episode as TRL's tool loop does (sample a turn, parse it, run its calls, append
    the results, sample again) and return the completion messages of each. `env` is one env for
    all episodes or one per episode. `first_calls` forces an episode's first turn to call that
    tool (teacher forcing, as rendered by the chat template) instead of sampling it."""
    envs = [env] * len(episodes) if isinstance(env, ms.MultiStepEnv) else list(env)
    contexts, boxes = _start_episodes(tokenizer, envs, episodes)
    messages: list[list[dict[str, Any]]] = [[] for _ in episodes]
    active = list(range(len(episodes)))
    forced = list(first_calls) if first_calls is not None else [None] * len(episodes)
    for turn in range(max_calls + 1):
        if not active:
            break
        sampled = active
        if turn == 0 and any(forced):
            sampled = [i for i in active if forced[i] is None]
            for i in active:
                name = forced[i]
                if name is not None:
                    turn_ids = _call_turn_ids(tokenizer, envs[i], episodes[i], name)
                    messages[i].append(_parse(tokenizer, turn_ids, contexts[i]))
                    contexts[i] += turn_ids
        turns = _generate(
            model, tokenizer, [contexts[i] for i in sampled], max_new_tokens, temperature
        )
        for i, new in zip(sampled, turns, strict=True):
            messages[i].append(_parse(tokenizer, new, contexts[i]))
            contexts[i] += new
        still = []
        for i in active:
            calls = messages[i][-1].get("tool_calls") or []
            if not calls or turn == max_calls:
                continue
            for call in calls:
                name, content = _run_call(boxes[i], episodes[i], call)
                messages[i].append({"role": "tool", "name": name, "content": content})
                contexts[i] += suffix_ids(tokenizer, name, content)
            still.append(i)
        active = still
    return messages


def _start_episodes(
    tokenizer: PreTrainedTokenizerBase,
    envs: Sequence[ms.MultiStepEnv],
    episodes: Sequence[ms.Episode],
) -> tuple[list[list[int]], list[Any]]:
    """Each episode's prompt as token ids (its tools listed) and its toolbox, reset to it."""
    contexts: list[list[int]] = []
    boxes = []
    for e, ep in zip(envs, episodes, strict=True):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": ep.prompt}],
            tools=tool_schemas(e, ep.tool_ids),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        contexts.append(list(ids))
        box = ms.toolbox_class(e, ep.tool_ids)()
        box.reset(**ep.row())
        boxes.append(box)
    return contexts, boxes


def _generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch: Sequence[list[int]],
    max_new_tokens: int,
    temperature: float,
) -> list[list[int]]:
    """One turn sampled for each context (left-padded into one batch): its ids up to and with
    end-of-turn, or all it generated without the padding."""
    import torch

    if not batch:
        return []
    pad = tokenizer.pad_token_id
    width = max(map(len, batch))
    input_ids = torch.tensor([[pad] * (width - len(c)) + c for c in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in batch], device=model.device)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **sampling,
        )
    turns = []
    for row in range(len(batch)):
        new = out[row, width:].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id) + 1]
        else:
            new = [t for t in new if t != pad]
        turns.append(new)
    return turns


def _run_call(box: Any, episode: ms.Episode, call: dict[str, Any]) -> tuple[str, str]:
    """(name, the tool message's content) of a parsed call run on the episode's toolbox; as
    TRL's, any tool failure is an observation, an unlisted tool one too."""
    name = call["function"]["name"]
    try:
        if name not in episode.tool_ids:
            raise ValueError(f"Tool {name} not found.")
        content = str(getattr(box, name)(**(call["function"].get("arguments") or {})))
    except Exception as exc:  # noqa: BLE001 - as TRL: any tool failure is an observation
        content = str({"error": str(exc)})
    return name, content


def _parse(tokenizer: PreTrainedTokenizerBase, ids: list[int], prefix: list[int]) -> dict[str, Any]:
    from trl.chat_template_utils import parse_response

    return parse_response(tokenizer, ids, prefix=prefix)


def _call_turn_ids(
    tokenizer: PreTrainedTokenizerBase, env: ms.MultiStepEnv, ep: ms.Episode, name: str
) -> list[int]:
    """The ids of an assistant turn calling `name`, as the chat template renders it."""
    tools = tool_schemas(env, ep.tool_ids)
    user = [{"role": "user", "content": ep.prompt}]
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    prompt = tokenizer.apply_chat_template(
        user, tools=tools, add_generation_prompt=True, return_dict=False
    )
    full = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": "", "tool_calls": call}],
        tools=tools,
        return_dict=False,
    )
    assert full[: len(prompt)] == prompt, "the chat template must preserve prefixes"
    return list(full[len(prompt) :])


def _first_call_ok(message: dict[str, Any], listed: Sequence[str]) -> tuple[bool, str | None]:
    """(exactly one parsed call with no arguments and no text around it, the name it calls);
    whether the name is listed is the caller's question."""
    calls = message.get("tool_calls") or []
    if message.get("role") != "assistant" or len(calls) != 1 or message.get("content"):
        return False, None
    function = calls[0].get("function", {})
    return function.get("arguments") in ({}, None), function.get("name")


def evaluate_format(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    variant: str,
    n: int,
    k: int = 4,
    seed: int = 0,
    batch_size: int = 32,
) -> dict[str, float]:
    """What the warm-up taught, measured at temperature 1 on held-out episodes (paraphrased
    queries, fresh id permutations, both kinds):

    - first_call_well_formed: the first turn is exactly one parsed call, no arguments, no text;
    - first_call_listed / first_call_right: ... naming a listed tool / the needed one (chance);
    - answer_copies_result: after a forced call to the right tool (single episodes where it is
      listed), the next turn is `<answer>V</answer>` with the V the result showed;
    - call_after_ticket / call_after_error: after a forced call to the ticket tool (chain) or to a
      failing tool (single), the next turn is a well-formed call to a listed tool.
    """
    import torch

    torch.manual_seed(seed)
    envs, episodes = _heldout_episodes(variant, n, k)
    first = _sampled(model, tokenizer, envs, episodes, None, batch_size)
    right = _sampled(model, tokenizer, envs, episodes, [ep.target for ep in episodes], batch_size)
    failing = [_failing_tool(e, ep) for e, ep in zip(envs, episodes, strict=True)]
    wrong = _sampled(model, tokenizer, envs, episodes, failing, batch_size)
    chains = [i for i, ep in enumerate(episodes) if ep.kind == "chain"]
    ticket = _sampled(
        model,
        tokenizer,
        [envs[i] for i in chains],
        [episodes[i] for i in chains],
        [episodes[i].needed[0] for i in chains],
        batch_size,
    )
    return _format_rates(episodes, first=first, right=right, wrong=wrong, ticket=ticket)


def _format_rates(
    episodes: Sequence[ms.Episode],
    *,
    first: Sequence[list[dict[str, Any]]],
    right: Sequence[list[dict[str, Any]]],
    wrong: Sequence[list[dict[str, Any]]],
    ticket: Sequence[list[dict[str, Any]]],
) -> dict[str, float]:
    """evaluate_format's rates from its conversations: sampled first turns, and the turn after
    a forced call to the right tool, to a failing one, to the ticket tool (chain episodes)."""
    n = len(episodes)
    chains = [i for i, ep in enumerate(episodes) if ep.kind == "chain"]
    calls = [_first_call_ok(c[0], ep.tool_ids) for c, ep in zip(first, episodes, strict=True)]
    answered = [
        (c, ep)
        for c, ep in zip(right, episodes, strict=True)
        if ep.kind == "single" and c[1].get("content") == f"result: {ep.answer}"
    ]
    return {
        "first_call_well_formed": sum(ok for ok, _ in calls) / n,
        "first_call_listed": sum(
            _listed_call(c[0], ep) for c, ep in zip(first, episodes, strict=True)
        )
        / n,
        "first_call_right": sum(
            ok and name == ep.needed[0] for (ok, name), ep in zip(calls, episodes, strict=True)
        )
        / n,
        # Over the episodes where the right tool is listed (held-out paraphrases can miss the
        # patched shortlist) and so returned the answer.
        "answer_copies_result": sum(
            ms.parse_answer(str(c[2].get("content", ""))) == ep.answer for c, ep in answered
        )
        / max(1, len(answered)),
        "call_after_ticket": sum(
            _listed_call(c[2], episodes[i]) for c, i in zip(ticket, chains, strict=True)
        )
        / max(1, len(chains)),
        "call_after_error": sum(
            _listed_call(c[2], ep) for c, ep in zip(wrong, episodes, strict=True)
        )
        / n,
    }


def _heldout_episodes(
    variant: str, n: int, k: int
) -> tuple[list[ms.MultiStepEnv], list[ms.Episode]]:
    """`n` held-out episodes, single and chain in turn, each in an env of its own seed."""
    envs, episodes = [], []
    for i in range(n):
        env = ms.MultiStepEnv(seed=1000 + i, variant=variant, k=k)
        query = env.heldout_queries[i % len(env.heldout_queries)]
        envs.append(env)
        episodes.append(env.episode(query.text, kind=ms.KINDS[i % 2], episode=i))
    return envs, episodes


def _listed_call(message: dict[str, Any], ep: ms.Episode) -> bool:
    """Whether `message` is a well-formed call to a tool the episode lists."""
    ok, name = _first_call_ok(message, ep.tool_ids)
    return ok and name in ep.tool_ids


def _failing_tool(env: ms.MultiStepEnv, ep: ms.Episode) -> str:
    """A listed tool that fails in `ep`, else any failing tool (unlisted: TRL's "not found")."""
    for tool_id in [*ep.tool_ids, *sorted(env.capability)]:
        try:
            env.observe(ep, tool_id)
        except ms.ToolError:
            return tool_id
    raise AssertionError("every tool answers this episode")


def _sampled(model, tokenizer, envs, episodes, first_calls, batch_size):  # type: ignore[no-untyped-def]
    """Conversations of up to one executed call (and the turn after it), in batches."""
    out = []
    for lo in range(0, len(episodes), batch_size):
        out += sample_conversations(
            model,
            tokenizer,
            envs[lo : lo + batch_size],
            episodes[lo : lo + batch_size],
            max_calls=1 if first_calls is not None else 0,
            first_calls=first_calls[lo : lo + batch_size] if first_calls is not None else None,
        )
    return out
