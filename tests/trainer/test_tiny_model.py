"""The default offline model: tokenizer, chat template, caching, and the warm-up's reply format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.trainer.builders import prebuilt, tiny_model
from rollout_lens.trainer.builders.tiny_model import (
    BUILD_STATS_FILE,
    CONTROL_TOKENS,
    RECIPE_HASH,
    tiny_model_dir,
)
from rollout_lens.trainer.envs.onestep import REPLY_FORMATS, EscalationEnv, corpus, reply


def test_model_dir_is_named_by_the_recipe_hash(tmp_path: Path) -> None:
    assert tiny_model_dir(tmp_path) == tmp_path / f"tiny-{RECIPE_HASH}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.mark.slow
def test_build_is_cached(tiny_model_dir: Path) -> None:
    stats_file = tiny_model_dir / BUILD_STATS_FILE
    before = stats_file.stat().st_mtime_ns
    lines: list[str] = []
    assert prebuilt.ensure(prebuilt.TINY, tiny_model_dir.parent, log=lines.append) == tiny_model_dir
    assert lines == []
    assert stats_file.stat().st_mtime_ns == before
    stats = json.loads(stats_file.read_text())
    assert stats["recipe_hash"] == RECIPE_HASH
    assert {"seconds", "params", "warmup_steps", "listed_id_rate", "accuracy"} <= set(stats)


@pytest.mark.slow
def test_reloaded_model_has_the_tokenizers_special_ids(tokenizer: Any, model: Any) -> None:
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(model.config, name) == getattr(tokenizer, name)
        assert getattr(model.generation_config, name) == getattr(tokenizer, name)
    assert tokenizer.eos_token == "</assistant>"
    assert 100_000 < model.num_parameters() < 600_000


@pytest.mark.slow
def test_tokenizer_round_trips_every_env_text(tokenizer: Any) -> None:
    for seed in (0, 11, 12345):  # seeds the tokenizer was not trained on, too
        for text in corpus(EscalationEnv(seed=seed)):
            assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@pytest.mark.slow
def test_tokenizer_round_trips_unseen_ascii(tokenizer: Any) -> None:
    text = "Query: zebra-crossing  costs $4.20?\n\tyes (maybe)"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_ids_and_control_tokens_are_single_tokens(tokenizer: Any) -> None:
    ids = tokenizer("<tool>tool_07</tool></assistant>")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<tool>", "tool_07", "</tool>", "</assistant>"]
    for i in range(64):
        assert len(tokenizer(f"tool_{i:02d}")["input_ids"]) == 1
        listing = tokenizer(f"\n- tool_{i:02d}: evaluate")["input_ids"]
        assert tokenizer.convert_ids_to_tokens(listing) == [
            "\n- ",
            f"tool_{i:02d}",
            ":",
            " evaluate",
        ]
    for token in CONTROL_TOKENS:
        assert len(tokenizer(token)["input_ids"]) == 1


@pytest.mark.slow
def test_tags_survive_skip_special_tokens_but_end_of_turn_does_not(tokenizer: Any) -> None:
    assert "<tool>" not in tokenizer.all_special_tokens
    assert "</tool>" not in tokenizer.all_special_tokens
    assert "</assistant>" in tokenizer.all_special_tokens
    for fmt in REPLY_FORMATS:
        ids = tokenizer(reply("tool_07", fmt) + "</assistant>")["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == reply("tool_07", fmt)


@pytest.mark.slow
def test_chat_template(tokenizer: Any) -> None:
    user = [{"role": "user", "content": "Tools:\n- tool_07: x"}]
    assert (
        tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        == "<user>Tools:\n- tool_07: x</user><assistant>"
    )
    turn = [*user, {"role": "assistant", "content": "<tool>tool_07</tool>"}]
    assert (
        tokenizer.apply_chat_template(turn, tokenize=False)
        == "<user>Tools:\n- tool_07: x</user><assistant><tool>tool_07</tool></assistant>"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<user>hi</user>"


@pytest.mark.slow
def test_leaky_prompt_fits_comfortably(tokenizer: Any) -> None:
    env = EscalationEnv(variant="leaky")
    chat = [{"role": "user", "content": env.example(env.train_queries[0]).prompt}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert len(ids) < 800


@pytest.mark.slow
def test_model_names_listed_tools_at_chance(tokenizer: Any, model: Any) -> None:
    measured = tiny_model.evaluate_replies(model, tokenizer, variant="patched", n=96, seed=1)
    assert measured["well_formed"] > 0.9
    assert measured["listed"] > 0.7
    # Warm-up never saw a target: accuracy must sit near chance (1/4), far from learned.
    assert measured["accuracy"] < 0.5


@pytest.mark.slow
def test_same_recipe_builds_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from safetensors.torch import load_file

    # A few steps show determinism as well as the full recipe and take seconds, not minutes.
    short = dataclasses.replace(tiny_model.RECIPE, steps=5, eval_prompts=2)
    monkeypatch.setattr(tiny_model, "RECIPE", short)
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        out.mkdir()
        stats = tiny_model.build_tiny_model(out, log=lambda _: None)
        assert stats["warmup_steps"] == 5
    weights = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert tensor.equal(weights[1][name]), name
