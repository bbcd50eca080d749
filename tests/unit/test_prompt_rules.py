"""A rendered prompt read back as chat messages (the prompt lens's export and its last user turn):
rendered here by the chat templates themselves (the tiny models' own, ChatML's), so the oracle
is the messages that went in."""

from __future__ import annotations

import random
import re
from typing import Any

import jinja2
import pytest
from rollout_lens.server.core.prompt_rules import chat_messages, last_user_turn
from rollout_lens.trainer.builders import multiturn_model, tiny_model

CHATML = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
TOOLS_USER = "Tools:\n- tool_07: record a voice memo\n- tool_44: generate a qr code\nQuery: a memo"


def _render(template: str, messages: list[dict[str, Any]], **extra: Any) -> str:
    env = jinja2.Environment()

    def _raise(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **extra)


CASES = [
    ("tiny", tiny_model.CHAT_TEMPLATE, [{"role": "user", "content": TOOLS_USER}]),
    (
        "tiny, two turns",
        tiny_model.CHAT_TEMPLATE,
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "<tool>tool_07</tool>"},
            {"role": "user", "content": TOOLS_USER},
        ],
    ),
    (
        "multi-turn tiny",
        multiturn_model.CHAT_TEMPLATE,
        [
            {"role": "user", "content": "a memo"},
            {"role": "assistant", "content": "calling"},
            {"role": "tool", "content": "saved"},
        ],
    ),
    (
        "ChatML",
        CHATML,
        [{"role": "system", "content": "You pick tools."}, {"role": "user", "content": TOOLS_USER}],
    ),
]


@pytest.mark.parametrize(
    ("template", "messages"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_rendered_prompt_reads_back_as_its_messages(
    template: str, messages: list[dict[str, Any]]
) -> None:
    rendered = _render(template, messages)
    assert chat_messages(rendered) == messages
    assert last_user_turn(rendered) == [m for m in messages if m["role"] == "user"][-1]["content"]


def test_a_text_in_no_template_is_one_user_message() -> None:
    text = "Pick a tool for: <b>a memo</b> (no chat template)"
    assert chat_messages(text) == [{"role": "user", "content": text}]
    assert last_user_turn(text) == text


# The templates as one lazy regex each, the way chat_messages read them before it found a turn's
# end with str.find: the oracle for texts drawn from every template's pieces.
ORACLE = (
    re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S),
    re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)(?:<\|eot_id\|>|$)", re.S),
    re.compile(r"<start_of_turn>(\w+)\n(.*?)(?:<end_of_turn>|$)", re.S),
    re.compile(r"<\|(system|user|assistant)\|>\n?(.*?)(?:<\|end\|>|$)", re.S),
    re.compile(r"<(system|user|assistant|tool_response)>(.*?)(?:</\1>|$)", re.S),
)
ROLES = {"model": "assistant", "tool_response": "tool"}
PIECES = [
    "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<start_of_turn>", "<end_of_turn>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>",
    "<user>", "</user>", "<assistant>", "</assistant>", "<tool_response>", "</tool_response>",
    "user", "assistant", "system", "model", "tool", "\n", "\n\n", " ", "<", ">", "|", "/",
    "words", "é 日本", "<|im_start|>user\n", "<|im_end|>\n", "<|im_start|>assistant\n",
]  # fmt: skip


def _oracle(text: str) -> list[dict[str, str]]:
    for pattern in ORACLE:
        found = [(m.group(1), m.group(2)) for m in pattern.finditer(text)]
        messages = [{"role": ROLES.get(r, r), "content": c.strip("\n")} for r, c in found]
        while messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
            messages.pop()
        if messages:
            return messages
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("seed", range(4))
def test_a_prompt_drawn_from_every_templates_pieces_reads_as_one_lazy_regex_reads_it(
    seed: int,
) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        assert chat_messages(text) == _oracle(text), text
