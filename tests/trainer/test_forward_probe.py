"""Logprobs and control-token probabilities read off TRL's own scoring pass, on every path.

The oracle is a plain forward pass (full logits, log-softmax at the run's temperature) of the
model as it was before the step: taken inside `_generate_and_score_completions`, right after
generation and before any update, over each rollout's own prompt and completion. Every recorded
rollout's per-token logprobs and control-token probabilities must equal it within float16
precision, whichever generator sampled it (generate, transformers' continuous batching, TRL's
tool loop); where generate's own probe exists, both readings are recorded in the same run and
must agree. Where transformers sampled (generate, continuous batching), the generator logprobs
(its SamplingProbe's) must equal the oracle too, tool results NaN: no top-k or top-p here, so
it samples from the oracle's distribution. vLLM cannot run here: its capture is built on a trainer configured
for it.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests import user_script as us
from tests.factories import load_run

pytestmark = pytest.mark.slow

# float16 precision: what the stored arrays keep and what the readings must agree to
REL = 1e-3
ABS = 5e-4
EOT = "<|im_end|>"


def _trainer(model_dir: Path, out: Path, **config: Any):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out),
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        bf16=False,  # the oracle's precision: float32 on both sides
        save_strategy="no",
        disable_tqdm=True,
        num_generations=4,
        temperature=0.7,
        logging_steps=1,
        max_steps=1,
        **config,
    )
    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[us.says_the_color],
        args=args,
        train_dataset=Dataset.from_list(us.conversational(us.questions(32))),
    )


def _oracle(trainer: Any, token_ids: list[int]) -> list[list[dict[str, Any]]]:
    """Per generation, per row: the plain forward pass's logprobs and control probabilities at
    the weights that sampled (wrapped before the callback, so it runs inside its capture)."""
    seen: list[list[dict[str, Any]]] = []
    original = trainer._generate_and_score_completions

    def observe(inputs):  # type: ignore[no-untyped-def]
        output = original(inputs)
        rows = []
        model = trainer.model
        with torch.no_grad():
            for i in range(len(inputs)):
                prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()]
                keep = output["completion_mask"][i].bool()
                ids = output["completion_ids"][i][keep]
                logits = model(torch.cat([prompt, ids])[None]).logits[0].float()
                logp = torch.log_softmax(logits / trainer.temperature, dim=-1)
                logp = logp[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
                mask = output["tool_mask"][i][keep].tolist() if "tool_mask" in output else None
                rows.append(
                    {
                        "ids": ids.tolist(),
                        "mask": mask,
                        "logprobs": logp.gather(1, ids[:, None]).squeeze(1).tolist(),
                        "control": logp[:, token_ids].exp().T.tolist(),
                    }
                )
        seen.append(rows)
        return output

    trainer._generate_and_score_completions = observe
    return seen


class Prepared:
    """A sink that prepares each step's records (as a writer would) and keeps them: the second
    reading of a run, beside the one written to the database (one writer a process)."""

    def __init__(self) -> None:
        self.prepare: Any = None
        self.records: list[Any] = []
        self.stop_requested = False  # no dashboard to cancel from

    def put(self, raw: Any) -> None:
        self.records.append(self.prepare(raw))

    def close(self, **_: Any) -> bool:
        return True


def _record(trainer: Any, url: str | None, **kwargs: Any) -> tuple[Any, list[Any]]:
    """A RolloutLensCallback on `trainer` writing to `url` (None: into a Prepared sink), with
    every generation it hands on kept here too."""
    from rollout_lens import RolloutLensCallback

    if url is None:
        kwargs["sink"] = Prepared()
    callback = RolloutLensCallback(project="probe", database_url=url, **kwargs)
    trainer.add_callback(callback)
    callback.attach(trainer)
    kept: list[Any] = []
    assert callback.capture is not None
    handed = callback.capture.on_generation
    callback.capture.on_generation = lambda g: (kept.append(g), handed(g))
    return callback, kept


def _assert_oracle(kept: list[Any], oracle: list[list[dict[str, Any]]]) -> int:
    """Every kept rollout equals the oracle within float16 precision, its generator logprobs
    too (the sampling distribution: no top-k or top-p here), NaN on tool results; returns how
    many."""
    assert len(kept) == len(oracle)
    n = 0
    for generation, truth in zip(kept, oracle, strict=True):
        assert len(generation.rollouts) == len(truth)
        for r, t in zip(generation.rollouts, truth, strict=True):
            assert r.record.completion_ids.tolist() == t["ids"]
            model = [True] * len(t["ids"]) if t["mask"] is None else [v == 1 for v in t["mask"]]
            expected = [lp if m else 0.0 for lp, m in zip(t["logprobs"], model, strict=True)]
            assert r.record.token_logprobs.tolist() == pytest.approx(expected, rel=REL, abs=ABS)
            sampled = [lp if m else math.nan for lp, m in zip(t["logprobs"], model, strict=True)]
            got = r.record.generator_logprobs.tolist()
            assert got == pytest.approx(sampled, rel=REL, abs=ABS, nan_ok=True)
            # the write entity's [position × token] array, as both probes hand it
            rows = r.record.control_probs.array.T
            assert len(rows) == len(t["control"])
            for got, want in zip(rows, t["control"], strict=True):
                want = [p if m else 0.0 for p, m in zip(want, model, strict=True)]
                assert got == pytest.approx(want, rel=REL, abs=ABS)
            n += 1
    return n


@pytest.mark.parametrize(
    "config",
    [
        # no old-policy pass: each rollout's first loss pass, over 2 shuffled micro-batches
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        # num_iterations=2: TRL's old-policy pass
        {"per_device_train_batch_size": 8, "num_iterations": 2},
    ],
    ids=["loss-pass", "old-policy-pass"],
)
def test_generate_both_readings_agree_with_the_pre_step_model(
    user_model_dir: Path, tmp_path: Path, config: dict[str, Any]
) -> None:
    trainer = _trainer(user_model_dir, tmp_path / "out", **config)
    eot = trainer.processing_class.convert_tokens_to_ids(EOT)
    oracle = _oracle(trainer, [eot])
    forward_url = f"sqlite:///{tmp_path / 'forward.db'}"
    # both readings of the same run: one capture wraps the other
    forward, forward_kept = _record(trainer, forward_url)
    generate, generate_kept = _record(trainer, None, reading="generate")
    assert forward.capture.reading == "forward" and generate.capture.reading == "generate"
    trainer.train()

    assert _assert_oracle(forward_kept, oracle) == 8
    assert _assert_oracle(generate_kept, oracle) == 8
    (record,) = generate.sink.records  # the generate reading's records, prepared
    assert [r.token_logprobs.tolist() for r in record.rollouts] == [
        r.record.token_logprobs.tolist() for r in generate_kept[0].rollouts
    ]
    for a, b in zip(forward_kept[0].rollouts, generate_kept[0].rollouts, strict=True):
        a_lp, b_lp = a.record.token_logprobs.tolist(), b.record.token_logprobs.tolist()
        assert a_lp == pytest.approx(b_lp, rel=REL, abs=ABS)
        a_c, b_c = a.record.control_probs.array.T[0], b.record.control_probs.array.T[0]
        assert a_c.tolist() == pytest.approx(b_c.tolist(), rel=REL, abs=ABS)
    # what was stored: the values, Σ logprob known, and the note saying where they were read
    run, rows, _, _ = load_run(forward_url, 1)
    assert run.control_tokens == [EOT]
    assert any("read off TRL's own scoring forward pass" in note for note in run.notes)
    for r in rows:
        assert len(r["token_logprobs"]) == len(r["completion_ids"])
        assert r["sum_logprob"] is not None and math.isfinite(r["sum_logprob"])
        assert len(r["control_token_probs"][EOT]) == len(r["completion_ids"])


@pytest.fixture(scope="module")
def cb_run(user_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One step with transformers' continuous batching (generate_batch: no logprobs, no
    logits), recorded twice: read off the scoring pass into a database, and with generate's
    reading (which cannot run there) into a Prepared sink."""
    tmp = tmp_path_factory.mktemp("cb")
    trainer = _trainer(
        user_model_dir,
        tmp / "out",
        per_device_train_batch_size=8,
        use_transformers_continuous_batching=True,
        # a bounded cache: by default continuous batching sizes it from the device's memory,
        # on CPU half of the machine's RAM, which other processes of a shared machine hold
        transformers_continuous_batching_config={"num_blocks": 32, "max_batch_tokens": 256},
    )
    eot = trainer.processing_class.convert_tokens_to_ids(EOT)
    oracle = _oracle(trainer, [eot])
    url = f"sqlite:///{tmp / 'lens.db'}"
    forward, kept = _record(trainer, url)
    unread, unread_kept = _record(trainer, None, reading="generate")
    trainer.train()
    return SimpleNamespace(
        url=url, oracle=oracle, kept=kept, unread=unread, unread_kept=unread_kept
    )


def test_continuous_batching_is_read_off_the_scoring_pass(cb_run: SimpleNamespace) -> None:
    """It stands for every generator that is not `generate` (vLLM's too): the reading does not
    depend on how a completion was sampled."""
    from rollout_lens.server.core import mismatch as mm

    assert _assert_oracle(cb_run.kept, cb_run.oracle) == 8
    run, rows, _, series = load_run(cb_run.url, 1)
    assert run.control_tokens == [EOT]
    (note,) = [n for n in run.notes if "scoring forward pass" in n]
    assert note.startswith("continuous-batching generation")
    # generate_batch's own logprobs (return_logprobs): the generator's side, and the figures
    assert "generate_batch returns with return_logprobs" in note
    assert all(len(r["generator_logprobs"]) == len(r["completion_ids"]) for r in rows)
    assert series[mm.ABS_DIFF_MAX][-1][1] < 1e-3  # no filter, float32: float rounding only
    for r, t in zip(rows, cb_run.oracle[0], strict=True):
        assert r["completion_ids"] == t["ids"]
        assert r["sum_logprob"] == pytest.approx(sum(t["logprobs"]), abs=1e-4)


def test_continuous_batching_with_generates_reading_records_no_numbers(
    cb_run: SimpleNamespace,
) -> None:
    """No fake numbers: generate's probe never runs under continuous batching, so that reading
    records no control tokens, no logprobs and Σ logprob unknown, and its notes say why."""
    callback = cb_run.unread
    assert callback.capture.reading is None and callback.control_tokens == []
    assert callback.capture.notes[-1] == (
        "continuous-batching generation: control-token probabilities are not recorded"
    )
    (record,) = callback.sink.records
    assert len(record.rollouts) == 8
    for r in record.rollouts:
        assert len(r.completion_ids) and len(r.token_logprobs) == 0 and r.control_probs == {}
        assert r.sum_logprob is None


@pytest.mark.browser
def test_continuous_batching_run_page_and_step_viewer(cb_run: SimpleNamespace) -> None:
    """The run's page says where its numbers were read; the step viewer shows each rollout's
    control-token row and Σ logprob from them (Chromium)."""
    from rollout_lens.server.core.config import Settings
    from rollout_lens.server.store import arrays
    from rollout_lens.server.store.db import make_engine, make_session_factory
    from rollout_lens.server.webapp.app import create_app
    from rollout_lens.server.webapp.pages.cells import prob_text

    from tests.web_support import chromium_browser, serve_app

    engine = make_engine(cb_run.url)
    app = create_app(
        Settings(database_url=cb_run.url), session_factory=make_session_factory(engine)
    )
    browsers = chromium_browser()
    browser = next(browsers)
    try:
        with serve_app(app) as base:
            page = browser.new_page()
            page.goto(f"{base}/runs/1")
            notes = page.locator(".recording-notes li").all_inner_texts()
            assert any(
                n.startswith("continuous-batching generation: per-token logprobs") for n in notes
            )
            page.goto(f"{base}/runs/1/steps/1/groups/0")
            first = cb_run.oracle[0][0]
            panel = page.locator(".tab-panel").first
            row = panel.locator("table.ctrl tr", has=page.locator(f"th:text-is('{EOT}')"))
            cells = row.locator("td").all_inner_texts()
            assert len(cells) == len(first["ids"])
            for cell, p in zip(cells, first["control"][0], strict=True):
                stored = p if p >= arrays.CONTROL_FLOOR else 0.0  # the floor reads 0
                # two decimals of a float16 value: the oracle's text, or its neighbour's
                assert cell in {prob_text(stored), prob_text(stored + 0.005)} | (
                    {prob_text(stored - 0.005)} if stored >= 0.005 else set()
                )
            shown = panel.locator(".stat", has_text="Σ logprob").locator(".value").inner_text()
            assert float(shown) == pytest.approx(sum(first["logprobs"]), abs=0.006)
            page.close()
    finally:
        browsers.close()
        engine.dispose()


def test_vllm_by_its_configuration(user_model_dir: Path, tmp_path: Path) -> None:
    """vLLM cannot run here; the reading does not depend on the generator, so what must hold is
    the capture's decision on a trainer configured for vLLM: read off the scoring pass (TRL's
    old-policy pass, which vLLM's importance-sampling correction always computes), with the note;
    and with the generate reading, nothing recorded but vLLM's own sampling logprobs."""
    from rollout_lens.trainer.recorder import capture as capture_module
    from rollout_lens.trainer.recorder.capture import RolloutCapture

    trainer = _trainer(user_model_dir, tmp_path / "out")
    trainer.use_vllm = True  # what GRPOTrainer sets from GRPOConfig(use_vllm=True)
    trainer.vllm_importance_sampling_correction = True
    capture = RolloutCapture(trainer, control_token_ids=[1], on_generation=print)
    assert capture.reading == "forward" and capture.probing
    (note,) = capture.notes
    assert note.startswith(
        "generation by vLLM (its sampling logprobs are recorded as the generator's)"
    )
    assert "read off TRL's own scoring forward pass at the weights that sampled" in note
    capture.install()
    assert capture.forward is not None
    assert isinstance(trainer._get_per_token_logps_and_entropies.func.__self__, RolloutCapture)

    fallback = RolloutCapture(
        _trainer(user_model_dir, tmp_path / "out2"),
        control_token_ids=[1],
        on_generation=print,
        reading="generate",
    )
    fallback.trainer.use_vllm = True
    assert capture_module.can_probe(fallback.trainer, fallback.notes) is False
    assert "control-token probabilities are not recorded" in fallback.notes[-1]
    sampled = torch.tensor([[-0.5, -1.0, 0.0]])
    output = {"sampling_per_token_logps": sampled}
    logprobs, control = fallback._gen.logprobs(fallback, output, [[4, 5]])  # float64 arrays
    assert [row.tolist() for row in logprobs] == [[-0.5, -1.0]] and control is None


def test_tool_calling_run_is_read_off_the_scoring_pass(
    multiturn_model_dir: Path, tmp_path: Path
) -> None:
    """TRL's tool loop generates turn by turn; the scoring pass reads the whole conversation at
    once, tool results at 0.0 (not sampled, not trained), and agrees with generate's probes
    stitched turn by turn."""
    from rollout_lens.server.core.runconfig import RunConfig
    from rollout_lens.trainer.escalation import multiturn as mt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(multiturn_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(multiturn_model_dir)
    config = RunConfig(turns="multi", variant="patched", episodes="mixed", steps=1, group_size=4)
    trainer = mt.make_trainer(config, model, tokenizer, tmp_path / "out")
    control: list[int] = []  # the callback's control tokens (tool-call tags, end of turn)
    oracle = _oracle(trainer, control)
    forward, forward_kept = _record(trainer, None)
    generate, generate_kept = _record(trainer, None, reading="generate")
    control.extend(forward.capture.control_token_ids)
    assert len(control) == 3
    trainer.train()

    n = _assert_oracle(forward_kept, oracle)
    assert n == _assert_oracle(generate_kept, oracle) == len(oracle[0])
    assert any(0 in t["mask"] for t in oracle[0])  # some rollouts called a tool
    for a, b in zip(forward_kept[0].rollouts, generate_kept[0].rollouts, strict=True):
        assert a.prompt_ids == b.prompt_ids  # the prompt as seen, from TRL's output
        a_lp, b_lp = a.record.token_logprobs.tolist(), b.record.token_logprobs.tolist()
        assert a_lp == pytest.approx(b_lp, rel=REL, abs=ABS)


def test_forward_probe_matches_full_logits_with_scale_and_soft_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's transform is TRL's fused head's (logit scale, soft cap, bias, temperature):
    checked on a module with all four against full logits, whole and a row at a time."""
    from rollout_lens.trainer.recorder import probe as probe_module
    from rollout_lens.trainer.recorder.probe import ForwardProbe

    torch.manual_seed(0)
    H, V = 8, 50
    head = torch.nn.Linear(H, V, bias=True)
    config = SimpleNamespace(
        final_logit_softcapping=3.0, logit_scale=0.5, get_text_config=lambda: config
    )
    model = SimpleNamespace(config=config, get_output_embeddings=lambda: head)
    probe = ForwardProbe(model, [3, 7], 0.7, after_token_id=5, watch_ids=[10, 11, 12])
    hidden = torch.randn(2, 4, H)
    labels = torch.tensor([[1, 5, 2, 9], [4, 4, 4, 4]])
    full = head(hidden) * 0.5
    full = 3.0 * torch.tanh(full / 3.0) / 0.7
    logp = torch.log_softmax(full, dim=-1)
    chunk = probe._chunk(hidden, labels)
    log_z = chunk.sampled - logp.gather(2, labels[..., None]).squeeze(2)
    assert torch.allclose(log_z, torch.logsumexp(full, dim=-1), atol=1e-5)
    control = torch.exp(chunk.control - log_z[..., None])
    assert torch.allclose(control, logp[..., [3, 7]].exp(), atol=1e-6)
    # the watched ids right after the opening tag (5, at position 1 of row 0): position 2
    assert list(chunk.watched) == [0]
    position, z = chunk.watched[0]
    assert position == 2
    assert torch.allclose(z - log_z[0, 2], logp[0, 2, [10, 11, 12]], atol=1e-5)
    # a row at a time (the probe bounds its float32 copies to POSITIONS positions)
    monkeypatch.setattr(probe_module, "POSITIONS", 4)
    rowwise = probe._chunk(hidden, labels)
    assert torch.allclose(rowwise.sampled, chunk.sampled, atol=1e-6)
    assert torch.allclose(rowwise.control, chunk.control, atol=1e-6)


def test_generate_probe_hands_float64_arrays_position_by_token() -> None:
    """GenerationProbe.finish: per row, log p of each sampled token [n] and the control tokens'
    probabilities [n × k] (the step entity's orientation), float64 arrays cut to the row's
    length, equal to the sampling distribution's; none (0 positions) when it never ran."""
    from rollout_lens.trainer.recorder.probe import GenerationProbe

    control_ids, temperature = [1, 3], 0.7
    probe = GenerationProbe(control_ids, temperature)
    assert [a.shape for a in probe.finish([[4], []])[1]] == [(0, 2), (0, 2)]
    probe = GenerationProbe(control_ids, temperature)
    generator = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 6, generator=generator) for _ in range(3)]
    rows = [[4, 2, 5], [1, 3]]  # the second row stopped after two tokens (then padding)
    seq = torch.tensor([[7], [7]])
    for t, step in enumerate(scores):
        probe(seq, step)
        sampled = torch.tensor([[rows[0][t]], [rows[1][t] if t < 2 else 0]])
        seq = torch.cat([seq, sampled], dim=1)
    logprobs, control = probe.finish(rows)
    for row, ids in enumerate(rows):
        dist = torch.log_softmax(torch.stack(scores)[:, row] / temperature, dim=-1).double()
        assert logprobs[row].dtype == np.float64 and logprobs[row].shape == (len(ids),)
        want = [dist[t, token].item() for t, token in enumerate(ids)]
        assert logprobs[row].tolist() == pytest.approx(want, rel=1e-6)
        assert control[row].dtype == np.float64 and control[row].shape == (len(ids), 2)
        expected = dist[: len(ids), control_ids].exp().numpy()
        assert control[row] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("fold", [None, 1, 2, 3])
def test_sampling_probe_reads_each_token_from_the_scores_it_was_drawn_from(
    monkeypatch: pytest.MonkeyPatch, fold: int | None
) -> None:
    """SamplingProbe keeps each position's scores and reads them a span at a time (FOLD_BYTES:
    here every `fold` positions, or once at the end): whatever the span, each row's log p of
    each token equals the log-softmax of the scores it was drawn from, the tokens from the next
    call's input_ids and the last from the completion ids; a row cut short keeps its own
    length; GenerationProbe too, whose kept scores are log-probabilities."""
    from rollout_lens.trainer.recorder import probe as probe_module
    from rollout_lens.trainer.recorder.probe import GenerationProbe, SamplingProbe

    vocab, batch = 6, 2
    if fold is not None:
        monkeypatch.setattr(probe_module, "FOLD_BYTES", fold * batch * vocab * 4)
    generator = torch.Generator().manual_seed(1)
    scores = [torch.randn(batch, vocab, generator=generator) for _ in range(5)]
    scores[2][0, 3] = -math.inf  # a token a warper filtered out, never drawn
    rows = [[4, 2, 5, 0, 1], [1, 3, 2]]  # the second row stopped after three tokens
    probes = [SamplingProbe(), GenerationProbe([1], 1.0)]
    for probe in probes:
        seq = torch.tensor([[7], [7]])
        for t, step in enumerate(scores):
            probe(seq, step)
            drawn = torch.tensor([[rows[0][t]], [rows[1][t] if t < len(rows[1]) else 0]])
            seq = torch.cat([seq, drawn], dim=1)
        assert probe.positions == len(scores)
        got = probe.sampled(rows)
        for row, ids in enumerate(rows):
            dist = torch.log_softmax(torch.stack(scores)[:, row], dim=-1).double()
            want = [dist[t, token].item() for t, token in enumerate(ids)]
            assert got[row].dtype == np.float64
            assert got[row].tolist() == pytest.approx(want, rel=1e-6)
