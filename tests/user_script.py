"""What a TRL user brings: their own tiny model, tokenizer, chat template, dataset and rewards.

Nothing here comes from Rollout Lens: the tests that record "a user's run" must not lean on the
project's own env or model. The model is a 2-layer Qwen3-style network with a word-level
tokenizer trained with `tokenizers` on the dataset's text, saved with `save_pretrained` and
loaded back by path, as a hub model would be.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def questions(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of a small dataset: name the colour that is asked for."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        color = rng.choice(COLORS)
        rows.append({"prompt": f"say the color {color} please", "answer": color})
    return rows


def conversational(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same rows as chat messages (the chat template applies)."""
    return [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows
    ]


def build_model(folder: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen3 causal LM and its tokenizer, saved under `folder`; returns the path."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (folder / "config.json").is_file():
        return folder
    words = {w for row in questions(200) for w in row["prompt"].split()} | set(COLORS)
    text = [" ".join(sorted(words)), "user assistant system", *[r["prompt"] for r in questions(50)]]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
        model_input_names=["input_ids", "attention_mask"],  # as Qwen's: no token_type_ids
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    save_qwen3(tokenizer, folder, seed=seed)
    (folder / "user_model.json").write_text(json.dumps({"seed": seed}))
    return folder


def save_qwen3(tokenizer: Any, folder: Path, *, seed: int) -> None:
    """A tiny random Qwen3 causal LM over `tokenizer`'s vocabulary (weights drawn with `seed`),
    saved with the tokenizer under `folder`, as `from_pretrained` loads them."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def says_the_color(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """The user's reward: 1 when the completion names the asked colour."""
    return [1.0 if a in _text(c) else 0.0 for c, a in zip(completions, answer, strict=True)]


def is_short(completions: list[Any], **_: Any) -> list[float]:
    """A second reward: shorter is better."""
    return [1.0 / (1.0 + len(_text(c).split())) for c in completions]


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


def project_folder(folder: Path) -> Path:
    """A user's project folder: their GRPO script (tests/scripts/user_grpo.py) with this module
    beside it, and a `trainer.py` and `server.py` of their own that must not shadow ours."""
    here = Path(__file__).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(here / "scripts" / "user_grpo.py", folder)
    shutil.copy(here / "user_script.py", folder)
    for name in ("trainer.py", "server.py"):
        (folder / name).write_text(f"raise SystemExit('the user\\'s own {name} was imported')\n")
    return folder
