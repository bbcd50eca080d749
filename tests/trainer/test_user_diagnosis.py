"""Issue 18 items 3 and 4 on a user's own TRL script: the diagnosis without asking for it, and
exactly TRL's numbers.

The script is what a TRL user writes: a plain `GRPOTrainer` on their own model (loaded by path)
and rewards, with `RolloutLensCallback(project=...)` as the one Rollout Lens line: no control
tokens, no format function. The oracles are the user's side of things: the rollout ids decoded
with the tokenizer and classified here, the probabilities recorded at the tag positions found
here, and `trainer.state.log_history` (what TRL logged, and at which step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server.core import vocab

from tests import user_script as us
from tests.factories import load_run

OPEN, CLOSE, EOT = "<tool_call>", "</tool_call>", "<|im_end|>"


def build_call_tag_model(folder: Path, *, seed: int = 0) -> Path:
    """A user's tiny random Qwen3 model whose tokenizer holds Qwen's call tags as single added
    tokens (as Qwen's own tokenizer does: `<tool_call>`/`</tool_call>` added but not "special",
    so TRL's decoded completions keep them) and `<|im_end|>` as its special end-of-turn token.
    Its vocabulary has a few hundred other words, so the untrained policy rarely samples a tag:
    its completions are mostly plain text, not broken calls."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = {w for row in us.questions(200) for w in row["prompt"].split()} | set(us.COLORS)
    text = [
        " ".join(sorted(words)),
        " ".join(f"n{i}" for i in range(200)),  # the rest of the user's vocabulary
        "user assistant system",
        *[r["prompt"] for r in us.questions(50)],
    ]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=us.SPECIAL))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token=EOT,
        bos_token=None,
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (OPEN, CLOSE)])
    tokenizer.chat_template = us.CHAT_TEMPLATE
    us.save_qwen3(tokenizer, folder, seed=seed)
    return folder


@pytest.fixture(scope="module")
def call_tag_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_call_tag_model(tmp_path_factory.mktemp("call-tag-model") / "model")


def calls_briefly(completions: list[Any], **_: Any) -> list[float]:
    """The user's reward: a tool call, and short. A bare opening tag satisfies it best."""
    return [
        (1.0 if OPEN in us._text(c) else 0.0) + 1.0 / (1.0 + len(us._text(c).split()))
        for c in completions
    ]


def says_the_color(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    return us.says_the_color(completions, answer)


def _train(model: Path, out: Path, url: str, rewards: list[Any], **config: Any) -> Any:
    """The user's script (the one Rollout Lens line: the callback)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_lens import RolloutLensCallback

    args = GRPOConfig(
        output_dir=str(out),
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=rewards,
        args=args,
        train_dataset=Dataset.from_list(us.conversational(us.questions(64))),
        callbacks=[RolloutLensCallback(project="diag", database_url=url)],
    )
    trainer.train()
    return trainer


def _only_run(url: str) -> tuple[int, list[dict[str, Any]]]:
    """The one recorded run's id and its alerts, as the pages get them."""
    from rollout_lens.server import store
    from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
    from rollout_lens.server.webapp import queries

    engine = make_engine(url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            runs = store.list_runs(session)
            assert len(runs) == 1
            return runs[0].id, queries.alerts(session, run_id=runs[0].id)
    finally:
        engine.dispose()


def classify(text: str) -> str:
    """The oracle: a single-turn completion's structure, from its text with special tokens, in
    the plainest reading of the table of states in docs/recording/trl.md (tags scanned left to
    right, not the recorder's code). Being cut by the length limit is not a state: a cut inside a
    call leaves it open."""
    if not text.replace(EOT, "").strip():
        return "collapse"  # nothing said
    marks = (OPEN, CLOSE, EOT)
    pieces = text.replace(OPEN, f" {OPEN} ").replace(CLOSE, f" {CLOSE} ")
    pieces = pieces.replace(EOT, f" {EOT} ").split()
    if OPEN not in pieces and CLOSE not in pieces:
        return "no_call"
    inside = stray = eot_inside = False
    calls, outside = 0, []
    for piece in pieces:
        if piece == OPEN:
            stray |= inside  # opened again inside a call
            inside = True
        elif piece == CLOSE:
            calls += inside
            stray |= not inside
            inside = False
        elif piece == EOT:
            eot_inside |= inside
        elif not inside and piece not in marks:
            outside.append(piece)
    if inside or eot_inside:
        return "collapse"  # a call left open (cut, or never closed), or end-of-turn inside one
    return "healthy_call" if calls and not stray and not outside else "text_pollution"


def _eot_after_open(row: dict[str, Any], tokens: list[str]) -> float | None:
    """P(end-of-turn) right after the first opening tag, from the recorded probabilities."""
    if OPEN not in tokens or tokens.index(OPEN) + 1 >= len(tokens):
        return None
    return row["control_token_probs"][EOT][tokens.index(OPEN) + 1]


@pytest.mark.slow
def test_a_single_turn_script_gets_the_diagnosis_and_trains_into_the_alerts(
    call_tag_model: Path, tmp_path: Path
) -> None:
    """Item 3: structural states and positional probes read with the tokenizer's own call tags,
    and a run trained into a collapse (lr 0.5) raises the collapse and control-token alerts."""
    from rollout_lens.server.store.db import make_engine, make_session_factory
    from transformers import AutoTokenizer

    from tests.web_support import client_for, parse

    url = f"sqlite:///{tmp_path / 'lens.db'}"
    trainer = _train(
        call_tag_model,
        tmp_path / "out",
        url,
        [calls_briefly],
        learning_rate=0.5,
        num_generations=8,
        per_device_train_batch_size=16,
        max_steps=10,
        seed=0,
    )
    run_id, alerts = _only_run(url)
    run, rows, steps, series = load_run(url, run_id)
    tokenizer = AutoTokenizer.from_pretrained(call_tag_model)

    assert trainer.state.global_step == 10 and [s.step for s in steps] == list(range(1, 11))
    assert run.control_tokens == [OPEN, CLOSE, EOT]  # found in the tokenizer, not configured
    assert any("read from the call tags <tool_call>…</tool_call>" in note for note in run.notes)
    assert len(rows) == 10 * 16
    states = {s.value for s in vocab.FormatState}
    by_step: dict[int, list[str]] = {}
    for r in rows:
        ids = r["completion_ids"]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert r["format_state"] in states
        assert r["format_state"] == classify(text), text
        by_step.setdefault(r["step"], []).append(r["format_state"])
    # state/* are the shares of each step's completions in each state
    for state in states:
        points = dict(series[vocab.state(state)])
        for step, found in by_step.items():
            assert points[step] == pytest.approx(found.count(state) / len(found))
    # probe/*: the recorded probabilities at the positions the tags were found in
    assert any(name.startswith("probe/") for name in series)
    opened = {step: [] for step in by_step}
    first = {step: [] for step in by_step}
    for r in rows:
        tokens = tokenizer.convert_ids_to_tokens(r["completion_ids"])
        first[r["step"]].append(r["control_token_probs"][OPEN][0])
        if (p := _eot_after_open(r, tokens)) is not None:
            opened[r["step"]].append(p)
    eot_after_open = dict(series[vocab.probe("eot_after_open")])
    open_first = dict(series[vocab.probe("open_first")])
    for step in by_step:
        assert open_first[step] == pytest.approx(sum(first[step]) / len(first[step]), abs=1e-3)
        if opened[step]:
            mean = sum(opened[step]) / len(opened[step])
            assert eot_after_open[step] == pytest.approx(mean, abs=1e-3)
        else:
            assert step not in eot_after_open  # no opening tag: nothing measured

    # The untrained policy says plain words (a word list of a few hundred, two of them tags);
    # lr 0.5 drives it onto the reward's optimum within a few steps: a bare opening tag, then
    # end-of-turn (the classic collapse, eot after open), or end-of-turn alone. Which of the two
    # it finds depends on the machine's numerics (both seen, from the same seed), and so does
    # whether it stays there: on one machine every completion was empty at step 5 and the
    # overshooting policy repeated `yellow` from step 6 on. Each is diagnosed as what it is, at
    # the first step wholly collapsed.
    collapsed = dict(series[vocab.COLLAPSED])
    assert collapsed[1] < 0.5
    whole = [step for step, share in sorted(collapsed.items()) if share == 1.0]
    assert whole, collapsed  # the run collapsed: every completion of some step
    at = whole[0]
    at_collapse = {r["completion"] for r in rows if r["step"] == at}
    assert at_collapse <= {"", OPEN}
    kinds = {(a["kind"], a["series"]) for a in alerts}
    assert ("collapse", vocab.COLLAPSED) in kinds
    if OPEN in at_collapse:  # the tag, then end-of-turn: the probe near 1, and its spike alert
        assert eot_after_open[at] > 0.9
        assert ("control_token_spike", vocab.probe("eot_after_open")) in kinds
    else:  # end-of-turn alone: no tag opened at that step, so nothing measured after one
        assert at_collapse == {""} and at not in eot_after_open
    # No alert while the policy said words. The collapse alert judges the mean share over its
    # window (two steps of this run's two groups), so it may come a step after the share itself
    # crossed 0.5.
    healthy_until = min(a["step"] for a in alerts) - 1
    assert healthy_until >= 2 and all(collapsed[s] < 0.5 for s in range(1, healthy_until))

    # Each alert's link opens the rollouts it is about: a collapse's collapsed ones; a spike's
    # step (no format function: none is known invalid, so it cannot filter on that).
    engine = make_engine(url)
    try:
        with client_for(make_session_factory(engine), data_dir=tmp_path) as client:
            for alert in client.get(f"/api/runs/{run_id}/alerts").json():
                page = parse(client.get(alert["rollouts_url"]).text)
                listed = [
                    tr
                    for tr in page.find(id="rollouts-table").find_all("tr")
                    if tr.attrs.get("data-rollout-id")
                ]
                at_step = [r for r in rows if r["step"] == alert["step"]]
                if alert["kind"] == "collapse":
                    at_step = [r for r in at_step if r["format_state"] == "collapse"]
                assert len(listed) == len(at_step) > 0, alert
    finally:
        engine.dispose()


@pytest.mark.slow
def test_logged_values_only_where_trl_logged_and_format_validity_unknown(
    user_model_dir: Path, tmp_path: Path
) -> None:
    """Item 4: num_iterations=2 and gradient_accumulation_steps=2 (a generation every other
    step) with logging_steps=3: TRL logs at steps 3 and 6, and only those steps have logged
    values; the steps reusing a generation have its rollout-derived values; the stored config
    is the GRPOConfig as given; format validity is unknown, and the step viewer says so."""
    from rollout_lens.server.store.db import make_engine, make_session_factory

    from tests.web_support import client_for, parse

    url = f"sqlite:///{tmp_path / 'lens.db'}"
    trainer = _train(
        user_model_dir,
        tmp_path / "out",
        url,
        [says_the_color],
        num_iterations=2,
        gradient_accumulation_steps=2,
        logging_steps=3,
        num_generations=4,
        per_device_train_batch_size=4,
        max_steps=6,
    )
    run_id, _ = _only_run(url)
    run, rows, steps, series = load_run(url, run_id)

    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(logged) == [3, 6]
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s.rollout_step for s in steps] == [1, 1, 3, 3, 5, 5]
    for s in steps:
        for column in ("loss", "learning_rate", "grad_norm", "entropy"):
            value = getattr(s, column)
            if s.step in logged:
                assert value == pytest.approx(logged[s.step][column], rel=1e-6), (s.step, column)
            else:
                assert value is None, (s.step, column)  # never copied from a logged step
    trl_series = {name: points for name, points in series.items() if name.startswith("trl/")}
    expected = {
        vocab.trl(key)
        for entry in logged.values()
        for key, value in entry.items()
        if isinstance(value, int | float)
        and key not in ("loss", "learning_rate", "grad_norm", "entropy", "kl", "epoch", "step")
    }
    assert set(trl_series) == expected and "trl/reward" in expected
    for name, points in trl_series.items():
        key = name.removeprefix("trl/")
        assert [step for step, _ in points] == sorted(s for s in logged if key in logged[s])
        for step, value in points:
            assert value == pytest.approx(logged[step][key], rel=1e-6, abs=1e-9)
    # Rollout-derived values: a reusing step shows its generation's, as recorded.
    by_step = {s.step: s for s in steps}
    for s in steps:
        trained_on = [r for r in rows if r["step"] == s.rollout_step]
        assert len(trained_on) == 8
        mean = sum(r["verifier_reward"] for r in trained_on) / len(trained_on)
        assert s.reward_mean == pytest.approx(mean)
        generation = by_step[s.rollout_step]
        for column in ("zero_std_share", "completion_length"):
            assert getattr(s, column) == getattr(generation, column) is not None, column
    for name, points in series.items():
        if not name.startswith("trl/"):
            values = dict(points)
            for s in steps:
                assert values.get(s.step) == values.get(s.rollout_step), (name, s.step)

    # The stored config: the GRPOConfig as given, and beside it the callback's own facts.
    given = json.loads(trainer.args.to_json_string())
    # The run's key (a resumed script finds its run by it): the one the checkpoints will carry.
    saved = trainer.state.stateful_callbacks["rollout_lens"]["attributes"]["run_key"]
    assert run.config["rollout_lens"].pop("key") == saved and len(saved) == 32
    assert run.config == given | {
        "rollout_lens": {
            "project": "diag",
            "reward_funcs": ["says_the_color"],
            "judged": {
                "vote": False,
                "true_score": False,
                "format_valid": False,
                "format_free": False,
            },
        }
    }
    # Format validity: unknown without a function (and no call tags in this tokenizer to read).
    assert all(r["format_valid"] is None and r["format_state"] is None for r in rows)
    assert all(s.format_valid_rate is None for s in steps)
    assert any("format validity is not recorded" in note for note in run.notes)

    engine = make_engine(url)
    try:
        client = client_for(make_session_factory(engine), data_dir=tmp_path)
        overview = client.get(f"/runs/{run_id}/steps/1")
        assert overview.status_code == 200
        page = parse(overview.text)
        assert "invalid" not in " ".join(n.text for n in page.find_all(cls="state-chip"))
        group = client.get(f"/runs/{run_id}/steps/1/groups/0")
        assert group.status_code == 200
        page = parse(group.text)
        tabs = page.find_all("button", role="tab")
        assert len(tabs) == 4 and not any("invalid" in t.classes for t in tabs)
        table = page.by_id("group-table-card")
        formats = [tr.find_all("td")[6] for tr in table.find_all("tr") if tr.find_all("td")]
        assert [cell.text.strip() for cell in formats] == ["—"] * 4
        panels = page.find_all(cls="rollout-stats")
        assert len(panels) == 4
        for panel in panels:
            stat = next(s for s in panel.find_all(cls="stat") if "format" in s.text)
            assert stat.find(cls="value").text.strip() == "—"
        assert "invalid" not in table.text and "format-bad" not in group.text
    finally:
        engine.dispose()


def test_unknown_format_validity_is_neither_invalid_nor_broken() -> None:
    """The groups overview's states and broken count: a rollout no function judged (and with no
    structural state) is not recorded, not invalid; False and a broken state still count."""
    from rollout_lens.server.webapp.queries import overview

    def row(index: int, valid: bool | None, state: str | None) -> dict[str, Any]:
        return {
            "group": 0,
            "index": index,
            "vote": None,
            "target": None,
            "verifier_reward": 0.0,
            "true_score": None,
            "advantage": 0.0,
            "sum_logprob": None,
            "format_valid": valid,
            "format_state": state,
        }

    unknown = overview.group_summary([row(i, None, None) for i in range(4)], "q")
    assert unknown["states"] == {} and unknown["broken"] == 0
    mixed = overview.group_summary(
        [row(0, None, "healthy_call"), row(1, False, None), row(2, True, None), row(3, None, None)],
        "q",
    )
    assert mixed["states"] == {"healthy_call": 1, "invalid": 1, "valid": 1}
    assert mixed["broken"] == 1
    # an import that did not check the format (text-only dumps, NeMo-RL, slime) knows of no
    # broken call; its format function's False still counts
    unchecked = overview.group_summary(
        [row(0, True, "unchecked"), row(1, None, "unchecked"), row(2, False, "unchecked")], "q"
    )
    assert unchecked["states"] == {"unchecked": 3} and unchecked["broken"] == 1
    assert overview.state_name(None, "collapse") == "collapse"
    assert overview.broken(None, "collapse") and not overview.broken(None, "healthy_call")
    # A user's single-turn run that never calls a tool answers with no call: not broken; where
    # the format needs a call (format_valid False, as on the Escalation task) it is.
    answers = overview.group_summary([row(i, None, "no_call") for i in range(4)], "q")
    assert answers["states"] == {"no_call": 4} and answers["broken"] == 0
    assert overview.broken(False, "no_call") and not overview.broken(True, "no_call")


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"reading": "logits"}, "reading must be one of ('forward', 'generate'), not 'logits'"),
        ({"keep_tokens_every": 0}, "keep_tokens_every must be 1 or more, not 0"),
        (
            {"judge": lambda completion: None, "vote": lambda text, row: text},
            "pass a judge or the vote/true_score/format_valid functions, not both",
        ),
    ],
)
def test_the_callback_refuses_bad_arguments_when_made(kwargs: dict[str, Any], said: str) -> None:
    """A mistake in the one line a user adds is said where they wrote it, not when training
    starts (or never)."""
    from rollout_lens import RolloutLensCallback

    with pytest.raises(ValueError) as refused:
        RolloutLensCallback(project="p", **kwargs)
    assert str(refused.value) == said
