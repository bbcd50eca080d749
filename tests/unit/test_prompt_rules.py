"""A rendered prompt read back as chat messages (the prompt lens's export and its last user turn):
rendered here by the chat templates themselves (the tiny models' own, ChatML's), so the oracle
is the messages that went in."""

from __future__ import annotations

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
