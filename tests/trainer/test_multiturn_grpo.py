"""Real multi-turn GRPO on the CPU: plain TRL GRPOTrainer, its own tool loop, the multi-step env."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.trainer.builders import multiturn_model as mm
from rollout_lens.trainer.envs import multistep as ms
from rollout_lens.trainer.escalation import multiturn as mt

pytestmark = pytest.mark.slow


def _train(trainer: Any) -> list[dict[str, Any]]:
    """Train, keeping what `_generate_and_score_completions` handed back each step (observed
    on the instance: the trainer itself is TRL's, unmodified)."""
    outputs: list[dict[str, Any]] = []
    original = trainer._generate_and_score_completions

    def observe(inputs):  # type: ignore[no-untyped-def]
        output = original(inputs)
        # TRL pools the ToolBoxes and resets them for the next batch: keep what each one saw now.
        boxes = [SimpleNamespace(ep=b.ep, calls=list(b.calls)) for b in trainer.environments]
        outputs.append({"output": output, "inputs": inputs, "environments": boxes})
        return output

    trainer._generate_and_score_completions = observe
    trainer.train()
    return outputs


def _load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize(("variant", "steps"), [("patched", 3), ("leaky", 2)])
def test_tiny_model_calls_tools_through_trls_loop(
    multiturn_model_dir: Path, tmp_path: Path, variant: str, steps: int
) -> None:
    torch.manual_seed(0)
    model, tokenizer = _load(multiturn_model_dir)
    config = RunConfig(
        turns="multi", variant=variant, steps=steps, group_size=4, prompts_per_step=2
    )
    trainer = mt.make_trainer(config, model, tokenizer, tmp_path)
    outputs = _train(trainer)

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == steps and len(outputs) == steps
    for log in logs:
        assert log["tools/call_frequency"] > 0  # the tools really ran
        assert 0.0 <= log["tools/failure_frequency"] <= 1.0
        assert 0.0 <= log["multiturn/true_accuracy"] <= 1.0
        assert log["multiturn/calls"] == pytest.approx(log["tools/call_frequency"])
        assert log["multiturn/turns"] >= 1.0
        assert log[f"rewards/{config.verifier}/mean"] == pytest.approx(
            log["multiturn/true_accuracy"]
        )

    eos = tokenizer.eos_token_id
    response_open, response_close = tokenizer.convert_tokens_to_ids(
        ["<tool_response>", "</tool_response>"]
    )
    called_any = False
    for seen in outputs:
        out = seen["output"]
        assert "tool_mask" in out and out["tool_mask"].shape == out["completion_ids"].shape
        for i, box in enumerate(seen["environments"]):
            ids = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
            mask = out["tool_mask"][i][out["completion_mask"][i].bool()].tolist()
            row = seen["inputs"][i]
            assert box.ep == ms.Episode.from_row(row)  # each rollout's ToolBox was reset on its row
            # Tool results are the tool_mask == 0 stretches: each opens with <tool_response>
            # right after an end of turn, and holds what the ToolBox returned (or TRL's own
            # error for a call the ToolBox never saw: a tool this prompt does not list).
            runs = _runs(mask)
            results = [ids[a:b] for value, a, b in runs if value == 0]
            texts = [tokenizer.decode(r) for r in results]
            ran = [t for t in texts if "not found." not in t]
            assert len(ran) == len(box.calls)
            for (name, observation), text in zip(box.calls, ran, strict=True):
                assert observation.removeprefix("error: ") in text
                assert name in row["tool_ids"]
            for result in results:
                assert result[0] == response_open and response_close in result
            for value, a, b in runs:
                if value == 1 and b < len(ids) and a < b:
                    assert ids[b - 1] == eos  # a model turn ends at the end of turn token
            called_any = called_any or bool(box.calls)
    assert called_any


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_facts_agree_with_what_the_tools_saw(multiturn_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    model, tokenizer = _load(multiturn_model_dir)
    config = RunConfig(turns="multi", variant="patched", episodes="chain", steps=1, group_size=8)
    trainer = mt.make_trainer(config, model, tokenizer, tmp_path)
    seen: dict[str, Any] = {}
    reward = trainer.reward_funcs[0]

    def spy(completions, **kwargs):  # type: ignore[no-untyped-def]
        seen["completions"], seen["environments"] = completions, kwargs["environments"]
        seen["rows"] = kwargs
        return reward(completions, **kwargs)

    spy.__name__ = reward.__name__
    trainer.reward_funcs[0] = spy
    trainer.train()
    for i, (messages, box) in enumerate(
        zip(seen["completions"], seen["environments"], strict=True)
    ):
        facts = ms.read_rollout(messages, seen["rows"]["needed"][i])
        # Every parsed call reached the ToolBox unless TRL refused it (unknown name, arguments).
        refused = sum(
            str(m["content"]).startswith("{'error': 'Tool ") or "argument" in str(m["content"])
            for m in messages
            if m["role"] == "tool"
        )
        assert facts.calls == len(box.calls) + refused
        assert [n for n, _ in box.calls] == [n for n in facts.called if n in box.ep.tool_ids][
            : len(box.calls)
        ]


# -- a model with a real Qwen chat template ----------------------------------------------------------

_QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _qwen_like(folder: Path) -> Path:
    """A random Qwen3 model whose tokenizer carries TRL's stored Qwen3 chat template (as shipped
    by Qwen/Qwen3-*) and no response template: nothing of the tiny model's format."""
    from tokenizers import AddedToken
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = mm.build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in _QWEN_SPECIALS])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.response_template = None
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def _scripted(model: Any, tokenizer: Any) -> None:
    """Make `model.generate` play a Qwen-format agent: call the first listed tool, then answer
    with the value a result showed (or 0). The weights still train; only sampling is scripted,
    since a random model never calls a tool."""

    def generate(input_ids, attention_mask=None, **_):  # type: ignore[no-untyped-def]
        turns = []
        for row in input_ids:
            text = tokenizer.decode(row)
            if "<tool_response>" not in text:
                name = re.search(r'"name": "(tool_\d\d)"', text).group(1)  # the first listed
                turn = (
                    f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call><|im_end|>'
                )
            else:
                found = re.findall(r"result: (\d+)", text)
                turn = f"<answer>{found[-1] if found else 0}</answer><|im_end|>"
            turns.append(tokenizer(turn, add_special_tokens=False)["input_ids"])
        width = max(map(len, turns))
        pad = tokenizer.pad_token_id
        new = torch.tensor([t + [pad] * (width - len(t)) for t in turns])
        return torch.cat([input_ids, new], dim=1)

    model.generate = generate


def test_a_qwen_chat_template_works_the_same_way(tmp_path: Path) -> None:
    path = _qwen_like(tmp_path / "qwen-like")
    model, tokenizer = _load(path)
    assert getattr(tokenizer, "response_template", None) is None
    _scripted(model, tokenizer)
    config = RunConfig(
        turns="multi",
        variant="patched",
        episodes="mixed",
        steps=2,
        group_size=2,
        prompts_per_step=2,
    )
    trainer = mt.make_trainer(config, model, tokenizer, tmp_path / "out")
    # TRL recognised the template and set its own Qwen3 parser on the tokenizer.
    assert trainer.processing_class.response_template is not None
    outputs = _train(trainer)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [log["tools/call_frequency"] for log in logs] == [1.0, 1.0]
    for seen in outputs:
        out = seen["output"]
        assert "tool_mask" in out and (out["tool_mask"] == 0).any()
        for i, box in enumerate(seen["environments"]):
            assert len(box.calls) == 1 and box.calls[0][0] == sorted(box.ep.tool_ids)[0]
            ids = out["completion_ids"][i][out["completion_mask"][i].bool()]
            text = tokenizer.decode(ids)
            # Qwen's own layout: the tool result comes back in a user turn, between its tags.
            assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n" in text
            assert text.endswith("<|im_end|>")
    # The scripted agent answers right exactly when the first listed tool is the one needed.
    for log in logs:
        assert 0.0 <= log["multiturn/true_accuracy"] <= 1.0
        assert log["multiturn/malformed_calls"] == 0.0
