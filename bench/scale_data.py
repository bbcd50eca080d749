"""The scale bench's data: GRPO steps of a user's shape (default 64 groups × 8 rollouts × ~1,024
tokens, a 150k vocabulary, 4 control tokens), seeded and deterministic, as a trainer records them.

- Vocabulary: decoded pieces (" word", "ing", ",", "\\n"), so a completion is exactly the
  concatenation of its tokens' texts (a writer may rebuild text from ids); ids Zipf-like over
  the vocabulary, frequent pieces mostly at low ids as in a BPE vocabulary; tool names, chat
  structure and control tokens are pieces of their own at the top.
- Prompts: a dataset of 5,000 tool listings (48–64 tools, a few KB each), drawn as epochs: each
  epoch a new shuffle of the dataset, read group after group, step after step (1,000 steps of
  64 groups: 12.8 epochs); a group's rollouts share its prompt.
- Completions: reasoning in <think>, then one call <tool_call>{"name": ...}</tool_call> and
  <|im_end|>; a few rollouts pollute the call with text, make none, or collapse (end-of-turn
  right after the opening tag). Lengths vary per rollout around the shape's mean.
- Numbers: per-token logprobs mostly near 0 with a tail; control-token probabilities mostly
  1e-9..1e-3 with rare spikes, near 1 where the token is sampled (the close tag at the call's
  end); rewards from the vote against the target, a few where the verifier disagrees with the
  truth; group-normalised advantages as TRL computes them; the step's series as the trainer
  logs them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rollout_lens.server.core import vocab
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.core.tokentext import BYTE_LEVEL, TEXT_RULES, piece_bytes
from rollout_lens.trainer.recorder import metrics as m

from bench.synthetic import TOOLS

CONTROL_CANDIDATES = ("<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>")
COMMON = (  # the most frequent pieces, most frequent first
    *(" the", ",", " of", ".", " and", " to", " a", "\n", " in", " is", " that", " for", " it"),
    *(" we", " call", " tool", " this", " with", " be", " on", " as", " query", " so", " not"),
    *(" can", " user", " I", " will", " need", " should", " which", " by", " or", " from"),
)
# Pieces whose positions the completion's structure fixes; the vocabulary's top ids.
COMMON_WORD = "need"
STRUCTURE = ("<think>", "</think>", "\n\n", '{"name": "', '", "arguments": {"query": "', '"}}')
STATES = ("healthy_call", "text_pollution", "no_call", "collapse")
STATE_SHARES = (0.88, 0.05, 0.04, 0.03)
ZIPF_EXPONENT = 1.07
TRL_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length")


@dataclass(frozen=True)
class Shape:
    """What a step holds: groups × group_size rollouts of ~tokens tokens each."""

    groups: int = 64
    group_size: int = 8
    tokens: int = 1024
    vocab: int = 150_000
    ctrl: int = 4
    prompts: int = 5_000  # the dataset's distinct prompts, drawn in epochs

    @property
    def rollouts(self) -> int:
        return self.groups * self.group_size

    @property
    def control_tokens(self) -> tuple[str, ...]:
        extra = tuple(f"<|ctrl_{i}|>" for i in range(max(0, self.ctrl - 4)))
        return (CONTROL_CANDIDATES + extra)[: self.ctrl]


ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z")
ONSETS += ("st", "tr", "pl", "ch", "sh", "th", "gr", "br")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea", "io")
CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st")
PUNCTUATION = (",", ".", ":", ";", ")", " (", "\n", " -", "'s")


def _words(rng: np.random.Generator, n: int) -> list[str]:
    """n pronounceable words, longer as their rank grows (drawn at once: 150k words in a
    Python loop of choices took seconds)."""
    syllables = 1 + np.minimum(2, (np.log10(np.arange(n) + 1) * rng.uniform(0.2, 0.6, n)))
    parts = [rng.integers(0, len(table), (n, 4)) for table in (ONSETS, VOWELS, CODAS)]
    out = []
    for i, count in enumerate(syllables.astype(int).tolist()):
        out.append(
            "".join(
                ONSETS[parts[0][i, s]] + VOWELS[parts[1][i, s]] + CODAS[parts[2][i, s]]
                for s in range(count)
            )
        )
    return out


class Vocabulary:
    """Token texts by id: Zipf-ranked pieces at the low ids, structure and control tokens on top."""

    def __init__(self, size: int, control_tokens: tuple[str, ...], seed: int) -> None:
        rng = np.random.default_rng(seed)
        tools = tuple(TOOLS)
        fixed = (*STRUCTURE, *tools, *control_tokens)
        self.n_ranked = size - len(fixed)
        pieces = list(COMMON)
        kinds = rng.random(self.n_ranked).tolist()
        marks = rng.integers(0, len(PUNCTUATION), self.n_ranked).tolist()
        words = _words(rng, self.n_ranked)
        for rank in range(len(pieces), self.n_ranked):
            # most pieces start a word; some continue one; a few are punctuation
            word = words[rank]
            if kinds[rank] < 0.8:
                pieces.append(" " + word)
            elif kinds[rank] < 0.97:
                pieces.append(word[: max(2, len(word) // 2)])
            else:
                pieces.append(PUNCTUATION[marks[rank]])
        # BPE ids roughly follow frequency: rank r gets an id near r, shuffled locally.
        order = np.argsort((np.arange(self.n_ranked) + 1) * rng.lognormal(0, 1, self.n_ranked))
        self.rank_to_id = np.empty(self.n_ranked, dtype=np.int64)
        self.rank_to_id[order] = np.arange(self.n_ranked)
        self.texts: list[str] = [""] * size
        for rank, piece in enumerate(pieces):
            self.texts[self.rank_to_id[rank]] = piece
        for offset, piece in enumerate(fixed):
            self.texts[self.n_ranked + offset] = piece
        self.ids = {piece: self.n_ranked + offset for offset, piece in enumerate(fixed)}
        self.ids["\n"] = int(self.rank_to_id[COMMON.index("\n")])
        weights = 1.0 / (np.arange(self.n_ranked) + 2.7) ** ZIPF_EXPONENT
        self.cdf = np.cumsum(weights / weights.sum())
        self.p_rank = weights / weights.sum()
        self.pieces = pieces

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n token ids drawn Zipf-like over the ranked pieces."""
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(n)), self.n_ranked - 1)
        return self.rank_to_id[ranks]

    def word(self, rank_at_least: int) -> str:
        """The first whole-word piece at or after `rank_at_least` (a search word), bare."""
        rank = rank_at_least
        while not (self.pieces[rank].startswith(" ") and self.pieces[rank][1:].isalpha()):
            rank += 1
        return self.pieces[rank][1:]

    def search_words(self, tokens: int) -> tuple[str, str]:
        """A rare word (some 30 uses in `tokens` tokens) and a common one that no prompt's
        template holds (in most long completions; not a stop word of PostgreSQL's English)."""
        rare = int(np.searchsorted(-self.p_rank * tokens, -30.0))
        return self.word(min(rare, self.n_ranked - 1)), COMMON_WORD

    def text(self, ids: np.ndarray) -> list[str]:
        texts = self.texts
        return [texts[i] for i in ids.tolist()]


@dataclass(frozen=True)
class DatasetRow:
    prompt: str
    target: str
    listed: tuple[str, ...]
    difficulty: float


def dataset(shape: Shape, words: Vocabulary, seed: int) -> list[DatasetRow]:
    """`shape.prompts` tool listings (48–64 tools described in a line each) with a query."""
    rng = np.random.default_rng(seed + 1)
    describe = {
        tool: "".join(words.text(words.sample(rng, int(rng.integers(6, 14))))).strip()
        for tool in TOOLS
    }
    rows = []
    for _ in range(shape.prompts):
        listed = tuple(rng.permutation(TOOLS)[: int(rng.integers(48, 65))].tolist())
        target = str(rng.choice(listed))
        query = "".join(words.text(words.sample(rng, int(rng.integers(12, 40))))).strip()
        listing = "\n".join(f"- {t}: {describe[t]}" for t in listed)
        prompt = (
            f"<|im_start|>system\nYou can call these tools:\n{listing}\n"
            "Call exactly one tool, as <tool_call>{...}</tool_call>.<|im_end|>\n"
            f"<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n"
        )
        rows.append(DatasetRow(prompt, target, listed, float(rng.beta(2.0, 1.5))))
    return rows


class ScaleRun:
    """The steps of one synthetic run of `shape` (seeded: the same steps every time)."""

    def __init__(self, shape: Shape, *, seed: int = 0) -> None:
        self.shape, self.seed = shape, seed
        self.control_tokens = shape.control_tokens
        self.words = Vocabulary(shape.vocab, self.control_tokens, seed)
        self.rows = dataset(shape, self.words, seed)
        self._epochs: dict[int, np.ndarray] = {}  # the current epoch's shuffle
        # how token texts become the completion, and how logprobs are drawn (use_real_text
        # changes both)
        self.decode: Callable[[Sequence[str]], str] = "".join
        self.logprobs: Callable[[np.random.Generator, int], np.ndarray] = _logprobs

    def picks(self, step: int) -> np.ndarray:
        """The dataset rows of step `step`'s groups: the run's groups read the dataset in
        epochs, each a seeded shuffle of it (as a trainer's sampler over its dataset)."""
        n, groups = len(self.rows), self.shape.groups
        first = (step - 1) * groups
        out = np.empty(groups, dtype=np.int64)
        for k in range(groups):
            epoch, at = divmod(first + k, n)
            if epoch not in self._epochs:
                self._epochs = {epoch: np.random.default_rng([self.seed, 1, epoch]).permutation(n)}
            out[k] = self._epochs[epoch][at]
        return out

    def step(self, step: int, *, tokens: int | None = None) -> StepRecord:
        """Step `step` with rollouts of ~`tokens` tokens (the shape's by default)."""
        shape = self.shape
        rng = np.random.default_rng([self.seed, step])
        mean_tokens = tokens or shape.tokens
        picks = self.picks(step)
        collapsing = 30 <= step % 50 < 33  # a stretch of broken calls every 50 steps (alerts)
        rollouts: list[RolloutRecord] = []
        for group, pick in enumerate(picks.tolist()):
            row = self.rows[pick]
            p_correct = min(0.97, row.difficulty * (0.6 + 0.4 * min(1.0, step / 300)))
            facts = {"row": pick, "tools_listed": len(row.listed)}
            members = [
                self._rollout(rng, row, group, i, p_correct, mean_tokens, collapsing, facts)
                for i in range(shape.group_size)
            ]
            _normalise_advantages(members)
            rollouts.extend(members)
        values, metrics = self._series(rng, step, rollouts)
        return StepRecord(
            step=step, rollout_step=step, values=values, rollouts=rollouts, metrics=metrics
        )

    def _rollout(
        self,
        rng: np.random.Generator,
        row: DatasetRow,
        group: int,
        index: int,
        p_correct: float,
        mean_tokens: int,
        collapsing: bool,
        facts: dict,
    ) -> RolloutRecord:
        shares = (0.5, 0.05, 0.05, 0.4) if collapsing else STATE_SHARES
        state = STATES[min(len(STATES) - 1, int(np.searchsorted(np.cumsum(shares), rng.random())))]
        right = rng.random() < p_correct
        wrong = [t for t in row.listed if t != row.target]
        vote = row.target if right else wrong[int(rng.integers(len(wrong)))]
        length = max(24, int(mean_tokens * math.exp(rng.normal(-0.045, 0.3))))
        ids, marks = self._completion(rng, state, vote, length)
        logprobs = self.logprobs(rng, len(ids))
        ctrl = self._control_probs(rng, len(ids), marks, logprobs)
        texts = self.words.text(ids)
        closes = marks.get("</tool_call>")
        probe = float(ctrl[1, closes[-1]]) if closes and len(ctrl) > 1 else None
        called = state in ("healthy_call", "text_pollution")
        reward = (1.0 if state == "healthy_call" else 0.5) if called and right else 0.0
        truth = float(called and right)
        if called and rng.random() < 0.03:  # the verifier wrong about this one
            reward = 1.0 - reward if reward in (0.0, 1.0) else 0.0
        record = RolloutRecord(
            group=group,
            index=index,
            prompt=row.prompt,
            completion=self.decode(texts),
            completion_ids=ids,  # arrays, as the capture hands them over
            token_logprobs=logprobs,
            control_probs={t: ctrl[k] for k, t in enumerate(self.control_tokens)},
            vote=vote if called else None,
            target=row.target,
            verifier_reward=reward,
            true_score=truth,
            advantage=0.0,
            format_valid=state == "healthy_call",
            format_state=state,
            meta={**facts, "probes": {"close_at_end": probe}},
        )
        # The pieces are clean text: skip the per-token scan for unstorable characters that
        # setting `tokens` runs (it was half of building a step, and building is not timed).
        object.__setattr__(record, "tokens", texts)
        return record

    def _completion(
        self, rng: np.random.Generator, state: str, vote: str, length: int
    ) -> tuple[np.ndarray, dict[str, list[int]]]:
        """Token ids of one completion and where each control token was sampled."""
        ids = self.words.ids
        args = self.words.sample(rng, int(rng.integers(6, 20)))
        head = [ids["</think>"], ids["\n\n"]]
        call = [ids["<tool_call>"], ids["\n"], ids['{"name": "'], ids[vote]]
        call += [ids['", "arguments": {"query": "'], *args.tolist(), ids['"}}'], ids["\n"]]
        call += [ids["</tool_call>"]]
        if state == "healthy_call":
            tail = call + [ids["<|im_end|>"]]
        elif state == "text_pollution":
            tail = call + self.words.sample(rng, int(rng.integers(5, 40))).tolist()
            tail += [ids["<|im_end|>"]]
        elif state == "no_call":
            tail = self.words.sample(rng, int(rng.integers(20, 80))).tolist() + [ids["<|im_end|>"]]
        else:  # collapse: end of turn right after the opening tag
            tail = [ids["<tool_call>"], ids["<|im_end|>"]]
        reasoning = self.words.sample(rng, max(4, length - len(tail) - 3))
        out = np.concatenate([[ids["<think>"]], reasoning, head, tail]).astype(np.int64)
        marks = {t: np.flatnonzero(out == ids[t]).tolist() for t in self.control_tokens}
        return out, marks

    def _control_probs(
        self, rng: np.random.Generator, n: int, marks: dict[str, list[int]], logprobs: np.ndarray
    ) -> np.ndarray:
        """Each control token's probability at each position: tiny, rare spikes, and the sampled
        token's own probability where it was sampled (the close tag near 1 at the call's end)."""
        probs = 10.0 ** np.minimum(rng.normal(-6.0, 1.2, (len(self.control_tokens), n)), -3.0)
        spikes = rng.random(probs.shape) < 0.002
        probs[spikes] = rng.uniform(0.01, 0.4, int(spikes.sum()))
        for k, token in enumerate(self.control_tokens):
            for position in marks.get(token, []):
                logprobs[position] = -rng.uniform(0.0005, 0.05)
                probs[k, position] = math.exp(logprobs[position])
        return probs

    def _series(
        self, rng: np.random.Generator, step: int, rollouts: list[RolloutRecord]
    ) -> tuple[dict[str, float | None], dict[str, float | None]]:
        """The step's values and series as the trainer computes them (trainer.recorder.summary.summarize)."""
        grouped = m.groups(rollouts, self.shape.group_size)
        rewards = [[r.verifier_reward for r in g] for g in grouped]
        lengths = [len(r.completion_ids) for r in rollouts]
        values: dict[str, float | None] = {
            "reward_mean": m.mean([r.verifier_reward for r in rollouts]),
            "true_accuracy": m.mean([r.true_score or 0.0 for r in rollouts]),
            "format_valid_rate": m.mean([float(r.format_valid) for r in rollouts]),
            "vote_agreement": m.mean([m.vote_agreement([r.vote for r in g]) for g in grouped]),
            "vote_entropy": m.mean([m.vote_entropy([r.vote for r in g]) for g in grouped]),
            "zero_std_share": m.mean([float(m.is_zero_std(g)) for g in rewards]),
            "completion_length": m.mean([float(n) for n in lengths]),
            "loss": float(rng.normal(0.0, 0.05)),
            "kl": abs(float(rng.normal(0.002 * math.log1p(step), 0.001))),
            "entropy": max(0.01, 1.2 * math.exp(-step / 400) + float(rng.normal(0, 0.03))),
            "grad_norm": abs(float(rng.normal(1.0, 0.4))),
            "learning_rate": 1e-6,
            "wall_time": float(rng.uniform(20, 40)),  # a GPU step of this shape
        }
        spread = [m.no_spread(g) for g in rewards]
        series: dict[str, float | None] = {
            vocab.SOLVED_GROUPS: m.mean([float(s == "solved") for s in spread]),
            vocab.STUCK_GROUPS: m.mean([float(s == "stuck") for s in spread]),
        }
        for token in self.control_tokens:
            arrays = [np.asarray(r.control_probs[token]) for r in rollouts]
            series[vocab.ctrl(token, "mean")] = float(np.concatenate(arrays).mean())
            series[vocab.ctrl(token, "max")] = float(max(a.max() for a in arrays))
        states = [r.format_state for r in rollouts]
        for state in STATES:
            series[vocab.state(state)] = states.count(state) / len(states)
        for key in TRL_KEYS:
            series[vocab.trl(key)] = float(rng.random())
        return values, series


def _logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """Sampled tokens' logprobs: most near 0, some a few tenths, a tail down to -25."""
    kind = rng.random(n)
    scale = np.where(kind < 0.6, 0.01, np.where(kind < 0.9, 0.4, 2.5))
    return -np.minimum(rng.exponential(scale), 25.0)


def _normalise_advantages(group: list[RolloutRecord]) -> None:
    """TRL's group-normalised advantage: (r - mean) / (std + 1e-4), std with Bessel's correction."""
    rewards = np.array([r.verifier_reward for r in group])
    std = float(rewards.std(ddof=1)) if len(group) > 1 else 0.0
    for r, reward in zip(group, rewards.tolist(), strict=True):
        r.advantage = (reward - float(rewards.mean())) / (std + 1e-4)


def trl_table(record: StepRecord) -> dict[str, list]:
    """The step as TRL's log_completions writes it (GRPOTrainer.log, trl 1.16): step, prompt,
    completion, a column per reward function, advantage."""
    rollouts = record.rollouts
    return {
        "step": [record.step] * len(rollouts),
        "prompt": [r.prompt for r in rollouts],
        "completion": [r.completion for r in rollouts],
        "tool_reward": [r.verifier_reward for r in rollouts],
        "advantage": [r.advantage for r in rollouts],
    }


# --- real text: a real tokenizer's ids of real text in several languages ----------------------

# The machine's own translations (gettext catalogs under /usr/share/locale): real sentences of
# real programs, in these languages, alongside English prose and Python.
LANGUAGES = ("de", "fr", "es", "ru", "zh_CN", "ja")
LOCALE_DIR = Path("/usr/share/locale")
# A completion's share of each kind of text: English prose, Python, the other languages.
SHARES = {"english": 0.3, "code": 0.3} | {lang: 0.4 / len(LANGUAGES) for lang in LANGUAGES}
_CONTINUATION = range(0x80, 0xC0)  # a UTF-8 byte that continues a character


def catalog_texts(path: Path) -> list[str]:
    """The translated strings of a gettext .mo file (its header and plural forms' separators
    left out): the format's table of (length, offset) pairs read with struct."""
    data = path.read_bytes()
    if len(data) < 20:
        return []
    order = "<" if struct.unpack_from("<I", data)[0] == 0x950412DE else ">"
    _, count, originals, translations = struct.unpack_from(order + "4I", data, 4)
    out = []
    for i in range(count):
        size, at = struct.unpack_from(order + "2I", data, translations + 8 * i)
        (original_size,) = struct.unpack_from(order + "I", data, originals + 8 * i)
        if original_size:  # the entry of msgid "" is the catalog's header
            text = data[at : at + size].decode("utf-8", "replace")
            out += [part for part in text.split("\0") if part.strip()]
    return out


class RealText:
    """Windows of a real tokenizer's ids over real text: English prose (this project's README
    and docs/, the machine's licence texts and vim's manual), Python (the standard library's
    modules) and six other languages (the gettext catalogs under /usr/share/locale: German,
    French, Spanish, Russian, Chinese, Japanese), about CORPUS_CHARS of English and of code
    and LANGUAGE_CHARS of each language. A completion is one window, of a kind drawn by
    SHARES; a window starts and ends where a character does (byte-level BPE splits a Chinese
    character over tokens), so its raw pieces decode to its text. The tokenizer is the
    real-model issue's, SmolLM2-135M-Instruct (`rollout-lens build-model --real`); its pieces
    are kept raw (byte-level BPE's 'Ġword'), as a trainer records them."""

    CORPUS_CHARS = 3_000_000
    LANGUAGE_CHARS = 400_000

    def __init__(self, tokenizer_dir: str) -> None:
        import sysconfig

        from transformers import AutoTokenizer

        root = Path(__file__).resolve().parent.parent
        english = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
        english += sorted(Path("/usr/share/common-licenses").glob("*"))
        english += sorted(Path("/usr/share/vim").glob("vim*/doc/*.txt"))
        code = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.vocab_size = len(tokenizer)
        self.pieces = dict(enumerate(tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))))
        self.newline = int(tokenizer.convert_tokens_to_ids("\u010a"))  # byte-level BPE's "\n"
        # whether each id's first byte starts a character (a window may begin at it)
        self.starts = np.array(
            [
                not piece_bytes(self.pieces[i], BYTE_LEVEL)[:1]
                or piece_bytes(self.pieces[i], BYTE_LEVEL)[0] not in _CONTINUATION
                for i in range(self.vocab_size)
            ]
        )

        def ids_of(texts: Iterable[str], most: int) -> np.ndarray:
            kept, size = [], 0
            for text in texts:
                if size >= most:
                    break
                kept.append(text)
                size += len(text)
            return np.asarray(tokenizer("\n".join(kept))["input_ids"], dtype=np.int64)

        def files(paths: list[Path]) -> Iterator[str]:
            for path in paths:
                if path.is_file():
                    yield path.read_text(encoding="utf-8", errors="replace")

        def catalogs(lang: str) -> Iterator[str]:
            for path in sorted((LOCALE_DIR / lang / "LC_MESSAGES").glob("*.mo")):
                yield from catalog_texts(path)

        self.sources = {
            "english": ids_of(files(english), self.CORPUS_CHARS),
            "code": ids_of(files(code), self.CORPUS_CHARS),
        }
        for lang in LANGUAGES:
            found = ids_of(catalogs(lang), self.LANGUAGE_CHARS)
            if len(found) > 1000:  # a machine without that language's catalogs goes without
                self.sources[lang] = found
        shares = np.array([SHARES[kind] for kind in self.sources])
        self.kinds, self.shares = list(self.sources), shares / shares.sum()

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """About n consecutive ids (a few fewer: whole characters) from a random place in a
        text of a kind drawn by SHARES."""
        source = self.sources[self.kinds[int(rng.choice(len(self.kinds), p=self.shares))]]
        n = min(n, len(source) - 1)
        while True:  # a stretch with two characters' starts at least: a window of whole ones
            start = int(rng.integers(0, len(source) - n))
            found = np.flatnonzero(self.starts[source[start : start + n + 1]])
            if len(found) >= 2:
                window = source[start + found[0] : start + found[-1]]
                try:  # the tokenizer made a few stray bytes of odd characters: not those
                    TEXT_RULES[BYTE_LEVEL]([self.pieces[i] for i in window.tolist()])
                except UnicodeDecodeError:
                    continue
                break
        return window.copy()


# The logprobs of tokens SmolLM2-135M-Instruct samples at temperature 1 (as GRPO samples) on
# RealText's windows: their quantiles at QUANTILE_LEVELS, in nats, measured by
# `record_logprobs` (`python -m bench.scale --record-logprobs`: 8,187 tokens, mean -2.59 nat, 5.5 %
# above -0.01 nat: a 135M model on text it did not write is unsure, more than a larger model on
# its own answers would be, so these logprobs cost more bits than many runs' would).
QUANTILE_LEVELS = (
    0,
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.12,
    0.14,
    0.16,
    0.18,
    0.2,
    0.22,
    0.24,
    0.26,
    0.28,
    0.3,
    0.32,
    0.34,
    0.36,
    0.38,
    0.4,
    0.42,
    0.44,
    0.46,
    0.48,
    0.5,
    0.52,
    0.54,
    0.56,
    0.58,
    0.6,
    0.62,
    0.64,
    0.66,
    0.68,
    0.7,
    0.72,
    0.74,
    0.76,
    0.78,
    0.8,
    0.82,
    0.84,
    0.86,
    0.88,
    0.9,
    0.92,
    0.94,
    0.96,
    0.98,
    0.99,
    0.995,
    0.999,
    1,
)
RECORDED_QUANTILES = (
    -16.861,
    -15.08,
    -13.04,
    -11.632,
    -10.504,
    -9.0017,
    -8.1148,
    -7.4392,
    -6.8492,
    -6.3887,
    -5.9876,
    -5.5597,
    -5.2189,
    -4.8706,
    -4.5733,
    -4.2657,
    -3.986,
    -3.728,
    -3.4501,
    -3.2019,
    -2.9834,
    -2.7576,
    -2.5648,
    -2.3784,
    -2.2011,
    -2.0067,
    -1.8143,
    -1.6549,
    -1.4958,
    -1.36,
    -1.2141,
    -1.0779,
    -0.96668,
    -0.85707,
    -0.75146,
    -0.67106,
    -0.56442,
    -0.48797,
    -0.41754,
    -0.35874,
    -0.29788,
    -0.24377,
    -0.19014,
    -0.15144,
    -0.11719,
    -0.092983,
    -0.068593,
    -0.048125,
    -0.032923,
    -0.020587,
    -0.011822,
    -0.0053717,
    -0.0017687,
    -0.00072298,
    -0.00030929,
    -3.2333e-05,
    0,
)


class LogprobSampler:
    """Logprobs drawn from a recorded run's distribution: the inverse of its empirical CDF (the
    quantiles of RECORDED_QUANTILES, linear between them), so the values' histogram, and with
    it the order-0 entropy a coder faces, is the real model's."""

    def __init__(self, levels: Sequence[float], quantiles: Sequence[float]) -> None:
        self.levels = np.asarray(levels, dtype=np.float64)
        self.quantiles = np.asarray(quantiles, dtype=np.float64)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        values: np.ndarray = np.interp(rng.random(n), self.levels, self.quantiles)
        return values


def record_logprobs(
    model_dir: str, real: RealText, *, tokens: int = 8192, seed: int = 0
) -> np.ndarray:
    """Logprobs of tokens the real model samples at temperature 1 (no top-k or top-p, TRL's
    GRPO default): one forward pass over windows of `real`'s texts gives the model's
    distribution at each position; a token is drawn from each and its logprob kept. (Sampling
    whole answers token by token took the busy two-core machine over a quarter of an hour;
    the contexts are then real text rather than the model's own, the distributions the
    model's.)"""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    width = 256
    windows = [real.sample(rng, width)[:width] for _ in range(tokens // width)]
    found = []
    with torch.no_grad():
        for window in windows:
            logits = model(torch.as_tensor(window[None, :])).logits[0].float()
            logprobs = torch.log_softmax(logits, -1)
            drawn = torch.multinomial(logprobs.exp(), 1)
            found.append(logprobs.gather(-1, drawn)[:, 0].numpy())
    values: np.ndarray = np.concatenate(found).astype(np.float64)
    return values


def use_real_text(run: ScaleRun, real: RealText, logprobs: LogprobSampler | None = None) -> None:
    """Make `run`'s completions windows of `real`, their texts its raw pieces decoded as
    byte-level BPE (its structure and control tokens stay the synthetic vocabulary's, at ids
    above the real tokenizer's), and, given a sampler, its logprobs drawn by it."""
    words = run.words
    if words.n_ranked < real.vocab_size:
        raise ValueError("the synthetic vocabulary must be larger than the real tokenizer's")
    for i, piece in real.pieces.items():
        words.texts[i] = piece
    words.ids["\n"] = real.newline  # the synthetic's newline fell among the real ids
    words.sample = real.sample  # type: ignore[method-assign]
    run.decode = TEXT_RULES[BYTE_LEVEL]
    if logprobs is not None:
        run.logprobs = logprobs.draw
