"""The vocabulary of what a run records: every series' name, label, unit and group, and the
structural states of a completion.

The trainer names what it records with these, the store and queries read them, alerts watch
them, figures draw them, and pages and scripts get them through the figure JSON the server
sends. Adding a series is one entry here plus the code that computes it.

Names: the per-step columns (STEP_SERIES) are plain (`reward_mean`); the rest are generic metrics
with a family prefix: `ctrl/<token>/<stat>`, `state/<state>`, `probe/<probe>/<part>`,
`eval/<set>`, `groups/<solved|stuck>`, `sft/…`, `trl/<TRL log key>`, `verl/<verl's key>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rollout_lens.server.core import mismatch

WINDOW = 25  # the 25-step window: buckets 1–25, 26–50, …, "last 25 steps", convergence
# Generic series names one run may hold: each is a value in every step's packed row, a chart on
# the run page and a name in its JSON (200,000 of them froze the server). An import past it is
# refused naming the line; the callback's writer records the first ones and warns about the rest.
MAX_SERIES_PER_RUN = 1000


@dataclass(frozen=True)
class Spec:
    """One series: `label` names it on charts, `unit` follows in parentheses, `group` says which
    section of the run page shows it (main, optimization)."""

    name: str
    label: str
    unit: str = ""
    group: str = "main"

    @property
    def title(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label


# --- the steps table's columns, in display order --------------------------------------------------

STEP_SPECS = (
    Spec("reward_mean", "verifier reward"),
    Spec("true_accuracy", "true accuracy"),
    Spec("format_valid_rate", "format-valid rate"),
    Spec("vote_agreement", "vote agreement"),
    Spec("vote_entropy", "vote entropy", "bits"),
    Spec("zero_std_share", "zero-std groups"),
    Spec("loss", "loss", group="optimization"),
    Spec("kl", "KL", group="optimization"),
    Spec("entropy", "entropy", group="optimization"),
    Spec("grad_norm", "grad norm", group="optimization"),
    Spec("learning_rate", "learning rate", group="optimization"),
    Spec("completion_length", "completion length", "tokens", group="optimization"),
    Spec("wall_time", "step wall time", "s", group="optimization"),
)
STEP_SERIES = tuple(s.name for s in STEP_SPECS)
OPTIMIZATION = tuple(s.name for s in STEP_SPECS if s.group == "optimization")
RETRIEVAL_RECALL = "retrieval_recall"  # share of rollouts whose target was listed
# Groups with no reward spread (zero_std_share), split: solved (every rollout at the top reward:
# the task is learned there) and stuck (all equal below it: nothing to learn from). Shares of
# the step's groups; solved + stuck = zero_std_share.
SOLVED_GROUPS = "groups/solved"
STUCK_GROUPS = "groups/stuck"
# Format-free accuracy: the answer read leniently, whatever the structure around it (single-turn:
# the first tool id named; multi-turn: the right tool called and the right final answer given,
# however malformed the turns). Beside true accuracy, the gap between the two is a skill hidden
# by a broken format. Each rollout's reading is its meta's FORMAT_FREE_KEY.
FORMAT_FREE_ACCURACY = "format_free_accuracy"
FORMAT_FREE_KEY = "format_free"
_SPECS = {s.name: s for s in STEP_SPECS} | {
    FORMAT_FREE_ACCURACY: Spec(FORMAT_FREE_ACCURACY, "format-free accuracy")
}


def label(name: str) -> str:
    """How a series is named on a chart: its label and unit, or the name itself."""
    spec = _SPECS.get(name)
    return spec.title if spec else name


# --- control tokens: the probability of each control token over completion positions ------------

CTRL_STATS = ("mean", "max")


def ctrl(token: str, stat: str = "mean") -> str:
    """`ctrl/<token>/<stat>`: a control token's per-step mean or max probability."""
    return f"ctrl/{token}/{stat}"


# --- structural states of a completion (trainer.recorder.structure classifies) ----------------------------


class FormatState(StrEnum):
    healthy_call = "healthy_call"  # exactly one well-formed call naming a listed id
    text_pollution = "text_pollution"  # a call plus stray text, or a call naming an unknown id
    collapse = "collapse"  # empty, unbalanced tags, truncated, or a bare opening tag
    no_call = "no_call"  # text with no call at all


STATES = tuple(FormatState)  # in the order charts stack them


def state(name: str) -> str:
    """`state/<state>`: the share of a step's completions in that structural state."""
    return f"state/{name}"


def state_label(name: str) -> str:
    return name.replace("_", " ")


# --- tool-calling rollouts: calls, turns, and the structure of each model turn --------------------

TOOL_CALLS = "tools/calls"  # tool calls per rollout (the calls TRL parsed and ran or not)
TOOL_TURNS = "tools/turns"  # model turns per rollout
RIGHT_TOOL_RATE = "tools/right_call_rate"  # share of calls to a tool the episode needs
TOOL_FAILURE_RATE = "trl/tools/failure_frequency"  # TRL's own: share of calls that failed
TOOL_SERIES = {
    TOOL_CALLS: "calls per rollout",
    TOOL_TURNS: "model turns per rollout",
    RIGHT_TOOL_RATE: "right-tool rate",
    TOOL_FAILURE_RATE: "tool failure rate",
}


class TurnState(StrEnum):
    """The structure of one model turn of a tool-calling rollout (trainer.recorder.turns.turn_state)."""

    healthy_call = "healthy_call"  # one or more well-formed calls and nothing else
    text_pollution = "text_pollution"  # closed calls with text around them, or unparsed
    open_call = "open_call"  # a call left open: the turn was cut before the closing tag
    eot_in_call = "eot_in_call"  # end-of-turn inside an open call
    no_call = "no_call"  # no call at all (an answer, or text)


TURN_STATES = tuple(TurnState)
TURN_POSITIONS = ("1", "2", "3+")  # the first model turn, the second, the third and later


def turn_position(index: int) -> str:
    """The position label of the model turn at 0-based `index`."""
    return TURN_POSITIONS[min(index, len(TURN_POSITIONS) - 1)]


def turn_state(position: str, name: str) -> str:
    """`turn/<position>/<state>`: the share of a step's model turns at that position (1, 2,
    3+) in that state."""
    return f"turn/{position}/{name}"


# --- probes: a control token where it matters, and the id position -------------------------------

# Positional probes (trainer.recorder.positional): (chart title, legend short enough for a third of the
# page). vocab.BELONGS says which are ~1 in a healthy call, vocab.MISPLACED which are ~0;
# eot_after_open is the classic collapse signal.
POSITIONAL_PROBES = {
    "eot_after_open": ("end-of-turn after the opening tag", "end-of-turn after open tag"),
    "close_after_id": ("closing tag after the id", "close tag after id"),
    "eot_after_close": ("end-of-turn after the closing tag", "end-of-turn after close tag"),
    "open_first": ("opening tag first", "open tag first"),
    "close_after_open": ("closing tag right after the opening tag", "close tag after open tag"),
    "eot_after_id": ("end-of-turn after the id", "end-of-turn after id"),
    "close_after_close": ("closing tag after the closing tag", "close tag after close tag"),
    # tool-calling rollouts, at the first position of a model turn after a tool result
    "open_after_result": ("opening tag after a tool result", "open tag after result"),
    "eot_after_result": ("end-of-turn after a tool result", "end-of-turn after result"),
}
# Id-position probes: log-probabilities and bits, not probabilities.
ID_PROBES = {
    "target_logprob": "Log-probability of the target id",
    "rival_logprob": "Log-probability of the best rival id",
    "id_entropy": "Entropy over the listed ids (bits)",
}
PROBE_STATS = ("mean", "p90", "max")  # over a step's rollouts
PROBE_SPLITS = ("reward1", "reward0", "supervised", "policy")  # means over a subset of them


def probe(name: str, part: str = "mean") -> str:
    """`probe/<probe>/<part>`: part is a stat, or `<split>/mean`."""
    return f"probe/{name}/{part}"


# --- evaluation and SFT phases ------------------------------------------------------------------

EVAL_SETS = {  # set → (legend, column header: words, not "ID", which reads as a run id)
    "id": ("in-distribution", "Eval: training queries"),
    "format_ood": ("format-OOD", "Eval: other reply format"),
    "content_ood": ("content-OOD", "Eval: paraphrased queries"),
    # verl's validation dumps (import-verl --validation): their mean true score, else score
    "validation": ("validation", "Eval: verl validation"),
}
LAUNCHED_EVAL_SETS = ("id", "format_ood", "content_ood")  # what runs launched here evaluate


def eval_set(name: str) -> str:
    """`eval/<set>`: greedy accuracy on that evaluation set, every E steps."""
    return f"eval/{name}"


EVAL_SERIES = tuple(eval_set(n) for n in EVAL_SETS)
SFT_LOSS = "sft/loss"  # mean loss of an SFT phase, at the step after which it ran
SFT_EXAMPLES = "sft/examples"  # examples in that phase


def trl(key: str) -> str:
    """`trl/<key>`: any other number TRL logs for a step."""
    return f"trl/{key}"


def verl(key: str) -> str:
    """`verl/<key>`: a number verl gives for a step (its file logger's metrics, a numeric key's
    step mean in its rollout dumps)."""
    return f"verl/{key}"


# --- what the alert rules read ------------------------------------------------------------------

# Where each control token belongs and where it does not, as the alert rules watch them. A
# control token's probability where it belongs is ~1 in every healthy call: its fall means another
# token took its place (the tiny model's collapse at lr 1e-3 loses the opening tag first). Where
# it does not belong it is ~0: its rise means a control token is winning at the wrong place. Not
# a control token's max over all positions: that is ~1 wherever it legitimately ends the reply.
BELONGS = ("open_first", "close_after_id", "eot_after_close")  # falling is the alarm
MISPLACED = (  # rising is the alarm
    "eot_after_open",
    "close_after_open",
    "eot_after_id",
    "close_after_close",
    "eot_after_result",  # a tool-calling turn that ends as soon as the result is in
)
# Watched without an alarm: after a ticket's result another call is right, after the answer's
# tool it is not, so neither its rise nor its fall alone is a fault.
NEUTRAL_PROBES = ("open_after_result",)
SPIKE_PROBES = tuple(probe(p) for p in MISPLACED)
DROP_PROBES = tuple(probe(p) for p in BELONGS)
COLLAPSED = state(FormatState.collapse)

# --- what compare overlays ------------------------------------------------------------------------

COMPARE_SERIES = ("reward_mean", "true_accuracy", "vote_agreement", "format_valid_rate")
# Besides each run's control-token means, where some run recorded them: series → (the compare
# section it is drawn in, its chart's title). The query reads these series; figures draws them.
COMPARE_EXTRA: dict[str, tuple[str, str]] = {
    **{
        eval_set(n): ("evaluation", f"Evaluation: {legend}") for n, (legend, _) in EVAL_SETS.items()
    },
    COLLAPSED: ("collapse", "Share of collapsed completions"),
    probe("eot_after_open"): ("collapse", "P(end-of-turn) after the opening tag"),
    FORMAT_FREE_ACCURACY: ("main", "Format-free accuracy"),
    TOOL_CALLS: ("tools", "Tool calls per rollout"),
    TOOL_TURNS: ("tools", "Model turns per rollout"),
    RIGHT_TOOL_RATE: ("tools", "Right-tool rate"),
    TOOL_FAILURE_RATE: ("tools", "Tool failure rate"),
    mismatch.ABS_DIFF_MEAN: ("mismatch", "|Δlogp| mean"),
    mismatch.ABS_DIFF_MAX: ("mismatch", "|Δlogp| max"),
    mismatch.K3_KL: ("mismatch", "k3 KL(generator ‖ trainer)"),
    mismatch.SEQ_RATIO_MIN: ("mismatch", "Sequence ratio min"),
    mismatch.SEQ_RATIO_MEAN: ("mismatch", "Sequence ratio mean"),
    mismatch.SEQ_RATIO_MAX: ("mismatch", "Sequence ratio max"),
    mismatch.OUTSIDE_2X: (
        "mismatch",
        f"Tokens outside [1/{mismatch.BANDS[0]:g}, {mismatch.BANDS[0]:g}]",
    ),
    mismatch.OUTSIDE_5X: (
        "mismatch",
        f"Tokens outside [1/{mismatch.BANDS[1]:g}, {mismatch.BANDS[1]:g}]",
    ),
}
