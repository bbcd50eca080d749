"""SFTPhases' loss, computed on the labelled columns alone, equals the cross-entropy of the whole
right-padded batch's logits: single-turn replies of different lengths, and labels spread over
several turns (a multi-turn row's assistant turns)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rollout_lens.trainer.escalation import supervision
from rollout_lens.trainer.escalation.supervision import SFTPhases
from transformers import LlamaConfig, LlamaForCausalLM


def _reference(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], pad: int) -> float:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in rows])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1)
    )
    return float(loss)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def _rows(spread: bool) -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for length, reply in ((40, 3), (25, 6), (33, 1)):
        ids = torch.randint(3, 97, (length,), generator=generator).tolist()
        labels = [-100] * (length - reply) + ids[length - reply :]
        if spread:  # earlier assistant turns labelled too, one from the row's first token
            labels[5:9] = ids[5:9]
            if length == 25:
                labels[0:3] = ids[0:3]
        rows.append((ids, labels))
    return rows


def _phases() -> SFTPhases:
    trainer = SimpleNamespace(
        processing_class=SimpleNamespace(pad_token_id=0),
        eos_token_ids=[2],
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    return SFTPhases(
        trainer,
        recorder=None,  # type: ignore[arg-type]
        mode="sft_then_rl",
        every=1,
        steps=1,
        learning_rate=1e-4,
        all_examples=list,
        encode=lambda row: row,
    )


@pytest.mark.parametrize("spread", [False, True], ids=["replies", "turns"])
def test_the_loss_on_the_labelled_columns_is_the_whole_batchs(spread: bool) -> None:
    model, rows, phases = _model(), _rows(spread), _phases()
    with torch.no_grad():
        got = float(phases._loss(model, rows))
        want, other = _reference(model, rows, pad=0), _reference(model, rows[:2], pad=0)
    assert got == pytest.approx(want, rel=1e-5)
    assert got != pytest.approx(other, rel=1e-3)  # the figure depends on the rows


@pytest.mark.parametrize("budget", [1, 70, 4096], ids=["a-row-each", "two-rows", "one-forward"])
def test_a_step_in_micro_batches_has_the_whole_batchs_gradient(
    budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, rows, phases = _model(), _rows(True), _phases()
    loss = torch.nn.functional.cross_entropy  # the reference: one forward, right padding
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([s + [0] * (width - len(s)) for s, _ in rows])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    want = loss(logits.reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1))
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    monkeypatch.setattr(supervision, "MICRO_BATCH_TOKENS", budget)
    forwards: list[int] = []
    handle = model.register_forward_hook(lambda m, a, k, out: forwards.append(1), with_kwargs=True)
    got = phases._backward(model, rows)
    handle.remove()
    assert len(forwards) == {1: 3, 70: 2, 4096: 1}[budget]  # rows of 40, 25 and 33 tokens
    assert got == pytest.approx(float(want.detach()), rel=1e-5)
    for name, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6)
