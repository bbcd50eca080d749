"""The offline multi-turn model: its own cache key, tokenizer, chat template with tool calls and
tool results, the response template TRL parses calls with, and the warm-up's call format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.trainer.builders import multiturn_model as mm
from rollout_lens.trainer.builders import prebuilt, tiny_model
from rollout_lens.trainer.envs import multistep as ms


def test_model_dir_is_its_own_cache_key(tmp_path: Path) -> None:
    assert mm.model_dir(tmp_path) == tmp_path / f"tiny-multiturn-{mm.RECIPE_HASH}"
    assert mm.model_dir(tmp_path) != tiny_model.tiny_model_dir(tmp_path)
    assert mm.RECIPE_HASH != tiny_model.RECIPE_HASH


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return mm.build_tokenizer()  # seconds; the same one the build saves


def test_tokenizer_keeps_calls_ids_values_and_tags_whole(tokenizer: Any) -> None:
    ids = tokenizer(mm.render_call("tool_07"), add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<tool_call>",
        '{"name": "',
        "tool_07",
        '", "arguments": ',
        "{}}",
        "</tool_call>",
        "</assistant>",
    ]
    # The value a result shows and the value an answer gives are the same token.
    result = tokenizer.convert_ids_to_tokens(tokenizer("result: 48")["input_ids"])
    answer = tokenizer.convert_ids_to_tokens(tokenizer(mm.render_answer("48"))["input_ids"])
    assert result == ["result", ":", " ", "48"]
    assert answer == ["<answer>", "48", "</answer>", "</assistant>"]
    for i in range(64):
        assert len(tokenizer(f"tool_{i:02d}")["input_ids"]) == 1
    for v in range(*ms.VALUE_RANGE):
        assert len(tokenizer(str(v))["input_ids"]) == 1
    for token in mm.CONTROL_TOKENS:
        assert len(tokenizer(token)["input_ids"]) == 1


def test_tags_survive_skip_special_tokens_but_end_of_turn_does_not(tokenizer: Any) -> None:
    # TRL decodes an unparsable turn with skip_special_tokens: a broken call must stay visible.
    broken = '<tool_call>{"name": "tool_07"</tool_call></assistant>'
    ids = tokenizer(broken, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == broken.removesuffix("</assistant>")
    assert (
        tokenizer.eos_token == "</assistant>" and "<tool_call>" not in tokenizer.all_special_tokens
    )


def test_tokenizer_round_trips_every_env_text(tokenizer: Any) -> None:
    for seed in (0, 11, 12345):
        for text in ms.corpus(ms.MultiStepEnv(seed=seed)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text


def _episode(variant: str = "patched", kind: str = "chain") -> tuple[ms.MultiStepEnv, ms.Episode]:
    env = ms.MultiStepEnv(seed=5, variant=variant)
    return env, env.episode(env.train_queries[2].text, kind=kind, episode=3)


def test_chat_template_lists_the_tools_and_renders_calls_and_results(tokenizer: Any) -> None:
    env, ep = _episode()
    tools = mm.tool_schemas(env, ep.tool_ids)
    user = [{"role": "user", "content": ep.prompt}]
    prompt = tokenizer.apply_chat_template(
        user, tools=tools, add_generation_prompt=True, tokenize=False
    )
    listing = ms.render_listing([(t, env.capability[t]) for t in ep.tool_ids])
    assert prompt == f"<user>{listing}\n{ep.prompt}</user><assistant>"
    calls = [{"type": "function", "function": {"name": ep.needed[0], "arguments": {}}}]
    turn = [
        *user,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": ep.needed[0], "content": "ticket: please x"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    assert tokenizer.apply_chat_template(turn, tools=tools, tokenize=False) == (
        prompt
        + mm.render_call(ep.needed[0])
        + mm.render_observation("ticket: please x")
        + mm.render_answer("5")
    )
    assert tokenizer.apply_chat_template(user, tokenize=False) == f"<user>{ep.prompt}</user>"
    with pytest.raises(Exception, match="no system role"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)


def test_trl_accepts_the_template_for_tool_calling(tokenizer: Any) -> None:
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)


def test_concatenated_turns_tokenize_as_the_whole_conversation(tokenizer: Any) -> None:
    # TRL builds a rollout by concatenating ids (prompt, sampled turn, tool suffix, ...), never
    # re-tokenizing; the warm-up trained on the same ids only if the two agree.
    env, ep = _episode()
    tools = mm.tool_schemas(env, ep.tool_ids)
    user = [{"role": "user", "content": ep.prompt}]
    prompt = tokenizer.apply_chat_template(
        user, tools=tools, add_generation_prompt=True, return_dict=False
    )
    pieces = list(prompt)
    pieces += tokenizer(mm.render_call(ep.needed[0]), add_special_tokens=False)["input_ids"]
    pieces += mm.suffix_ids(tokenizer, ep.needed[0], "result: 48")
    pieces += tokenizer(mm.render_answer("48"), add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(pieces)
    assert tokenizer(whole, add_special_tokens=False)["input_ids"] == pieces
    assert (
        mm.suffix_ids(tokenizer, "tool_01", "result: 48")
        == tokenizer(mm.render_observation("result: 48"), add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        (mm.render_call("tool_07"), ["tool_07"], ""),
        (
            mm.render_call("tool_07").removesuffix("</assistant>") * 2 + "</assistant>",
            ["tool_07"] * 2,
            "",
        ),
        (mm.render_answer("48"), [], "<answer>48</answer>"),
        # Broken JSON: TRL falls back to the decoded text, so the attempt shows as content.
        (
            '<tool_call>{"name": "tool_07", "arguments": {}</tool_call></assistant>',
            [],
            '<tool_call>{"name": "tool_07", "arguments": {}</tool_call>',
        ),
        ('<tool_call>{"name": "tool_07"', [], '<tool_call>{"name": "tool_07"'),
    ],
)
def test_response_template_parses_calls(
    tokenizer: Any, text: str, calls: list[str], content: str
) -> None:
    from trl.chat_template_utils import parse_response

    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, return_dict=False
    )
    parsed = parse_response(
        tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"], prefix=prefix
    )
    assert [c["function"]["name"] for c in parsed.get("tool_calls") or []] == calls
    assert all(c["function"]["arguments"] == {} for c in parsed.get("tool_calls") or [])
    assert parsed["content"] == content


@pytest.fixture(scope="module")
def built(multiturn_model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(multiturn_model_dir)
    return tok, AutoModelForCausalLM.from_pretrained(multiturn_model_dir).eval()


@pytest.mark.slow
def test_build_is_cached_and_self_contained(
    multiturn_model_dir: Path, built: tuple[Any, Any]
) -> None:
    stats_file = multiturn_model_dir / mm.BUILD_STATS_FILE
    before = stats_file.stat().st_mtime_ns
    lines: list[str] = []
    assert (
        prebuilt.ensure(prebuilt.MULTITURN, multiturn_model_dir.parent, log=lines.append)
        == multiturn_model_dir
    )
    assert lines == [] and stats_file.stat().st_mtime_ns == before
    stats = json.loads(stats_file.read_text())
    assert stats["recipe_hash"] == mm.RECIPE_HASH
    assert {"seconds", "params", "warmup_steps", "leaky", "patched"} <= set(stats)
    tok, model = built
    # What TRL needs travels with the folder: the chat template and the response template.
    assert tok.chat_template == mm.CHAT_TEMPLATE
    assert tok.response_template == mm.RESPONSE_TEMPLATE
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert 100_000 < model.num_parameters() < 600_000


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "n"), [("patched", 64), ("leaky", 32)])
def test_warm_up_makes_well_formed_calls_at_chance(
    built: tuple[Any, Any], variant: str, n: int
) -> None:
    tok, model = built
    # Held-out paraphrases under fresh id permutations, both kinds of episode, temperature 1.
    measured = mm.evaluate_format(model, tok, variant=variant, n=n, seed=1)
    assert measured["first_call_well_formed"] > 0.9
    assert measured["first_call_listed"] > 0.7
    assert measured["first_call_right"] < 0.3  # warm-up never saw a right tool: near chance
    assert measured["answer_copies_result"] > 0.9
    assert measured["call_after_ticket"] > 0.6
    assert measured["call_after_error"] > 0.6


@pytest.mark.slow
def test_same_recipe_builds_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from safetensors.torch import load_file

    monkeypatch.setattr(mm, "RECIPE", dataclasses.replace(mm.RECIPE, steps=4, eval_prompts=2))
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        out.mkdir()
        assert mm.build_multiturn_model(out, log=lambda _: None)["warmup_steps"] == 4
    weights = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert tensor.equal(weights[1][name]), name
