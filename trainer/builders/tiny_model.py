"""Build the default offline model: a tiny Llama that knows the reply format but not the answers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_lens.trainer.envs import onestep as esc

if TYPE_CHECKING:  # torch and transformers load lazily: importing this module stays cheap
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

try:
    import fcntl
except ImportError:  # Windows: fall back to rename-wins
    fcntl = None  # type: ignore[assignment]

TINY_MODEL_NAME = "tiny"
CONTROL_TOKENS = ("<tool>", "</tool>", "</assistant>")  # opening tag, closing tag, end-of-turn
BUILD_STATS_FILE = "rollout_lens_build.json"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}<user>{{ text }}</user>"
    "{%- elif message['role'] == 'assistant' -%}<assistant>{{ text }}</assistant>"
    "{%- else -%}{{ raise_exception('the tiny model has no ' ~ message['role'] ~ ' role') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)

# Pieces: the list bullet, tags, tool ids, words with their leading space, punctuation, single
# whitespace characters. Ids and tags stay whole so each is one token; whitespace is kept as
# pieces so decode (a plain Fuse) reproduces the text exactly.
_SPLIT_PATTERN = r"\n- |</?tool>|tool_\d{2}| ?(?!tool_\d)[^\W_]+|[^\w\s]|\s"
PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<bos>", "</assistant>"
# Turn markers are single tokens but not special: a stray one stays visible in a decoded reply.
_TURN_TOKENS = ("<user>", "</user>", "<assistant>")
_TOKENIZER_SEEDS = range(8)  # several id permutations, so the vocabulary does not depend on a seed


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that decides the built model; its hash names the cache directory."""

    seed: int = 0
    hidden_size: int = 64
    layers: int = 2
    heads: int = 2  # 32-dim heads: copying an id needs room more than it needs many heads
    intermediate_size: int = 256
    max_positions: int = 2048
    # A wider init than HF's 0.02 leaves the copy-a-listed-id plateau within ~100 steps, not ~1000.
    init_std: float = 0.1
    id_type_init: float = 1.0
    id_orthogonal_init: bool = True
    steps: int = 700
    lr: float = 6e-3  # 2e-2 stalls on the plateau; 5e-3 and 1e-2 both leave it
    lr_warmup_steps: int = 30
    weight_decay: float = 0.0
    tokens_per_step: int = 4096
    min_tools: int = 2
    max_tools: int = esc.TOOL_COUNT
    first_max_tools: int = 4
    curriculum_steps: int = 300
    short_share: float = 0.6
    short_max_tools: int = 16
    eval_prompts: int = 192


RECIPE = TinyRecipe()


def recipe_hash(recipe: TinyRecipe, sources: Sequence[Path]) -> str:
    """Names a build: the recipe, the source files whose code and text it learns from, and the
    libraries that save it."""
    digest = hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True).encode())
    for path in sources:
        digest.update(path.read_bytes())
    for package in ("torch", "transformers", "tokenizers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{package}=={metadata.version(package)}".encode())
    return digest.hexdigest()[:12]


RECIPE_HASH = recipe_hash(RECIPE, (Path(__file__), Path(esc.__file__)))


def tiny_model_dir(cache_dir: Path) -> Path:
    """Where the model for the current recipe lives under `cache_dir`."""
    return Path(cache_dir) / f"{TINY_MODEL_NAME}-{RECIPE_HASH}"


def ensure_built(final: Path, build: Callable[[Path], Any]) -> Path:
    """`final`, built by `build(staging folder)` first if it is missing: once across processes
    (a file lock), into a staging folder renamed into place, so a killed build leaves nothing
    that looks built."""
    if (final / BUILD_STATS_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final.parent / f".{final.name}.lock"):
        if (final / BUILD_STATS_FILE).is_file():  # another process built it while we waited
            return final
        for stale in final.parent.glob(f".{final.name}-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            build(staging)
            try:
                staging.rename(final)
            except OSError:
                if not (final / BUILD_STATS_FILE).is_file():
                    raise  # not a lost race: a real failure
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process builds
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_tiny_model(out_dir: Path, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train tokenizer and warm-up into `out_dir`; return the build stats."""
    return build_model(
        out_dir,
        "tiny model",
        RECIPE,
        RECIPE_HASH,
        tokenizer=build_tokenizer,
        new_model=fresh_model,
        warm_up=_warm_up,
        evaluate=lambda model, tokenizer, variant: evaluate_replies(
            model, tokenizer, variant=variant, n=RECIPE.eval_prompts
        ),
        headline=lambda stats: {
            "listed_id_rate": stats["patched"]["listed"],
            "accuracy": stats["patched"]["accuracy"],
        },
        log=log,
    )


def build_model(
    out_dir: Path,
    label: str,
    recipe: TinyRecipe,
    built_hash: str,
    *,
    tokenizer: Callable[[], PreTrainedTokenizerBase],
    new_model: Callable[[PreTrainedTokenizerBase, Any], PreTrainedModel],
    warm_up: Callable[..., dict[str, Any]],
    evaluate: Callable[[PreTrainedModel, PreTrainedTokenizerBase, str], dict[str, float]],
    headline: Callable[[dict[str, Any]], dict[str, Any]] = lambda stats: {},
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Build a tiny model into `out_dir`: the tokenizer, the model, its warm-up, its evaluation
    on both variants (in the stats), then save_built."""
    import torch

    started = time.perf_counter()
    threads = torch.get_num_threads()
    # One thread: the same weights whatever the core count, and no collapse when other jobs
    # share the cores (two spinning OpenMP pools on two cores ran 4.5x slower than one thread).
    torch.set_num_threads(1)
    try:
        torch.manual_seed(recipe.seed)
        built_tokenizer = tokenizer()
        model = new_model(built_tokenizer, recipe)
        params = sum(p.numel() for p in model.parameters())
        log(f"{label}: vocab {len(built_tokenizer)}, {params:,} parameters")
        stats = warm_up(model, built_tokenizer, recipe, log)
        model.eval()
        for variant in esc.VARIANTS:
            measured = evaluate(model, built_tokenizer, variant)
            summary = ", ".join(f"{k} {v:.3f}" for k, v in measured.items())
            log(f"{label} on {variant} prompts: {summary}")
            stats[variant] = measured
    finally:
        torch.set_num_threads(threads)
    stats |= headline(stats)
    return save_built(out_dir, built_tokenizer, model, stats, recipe, built_hash, started, log)


def save_built(
    out_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    stats: dict[str, Any],
    recipe: TinyRecipe,
    built_hash: str,
    started: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Save a built model and tokenizer with their build stats (what makes the folder built)."""
    stats = stats | {
        "recipe": asdict(recipe),
        "recipe_hash": built_hash,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
    }
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    stats["seconds"] = round(time.perf_counter() - started, 1)
    (out_dir / BUILD_STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    log(f"model built in {stats['seconds']}s at {out_dir}")
    return stats


def build_tokenizer() -> PreTrainedTokenizerBase:
    """A BPE tokenizer that keeps every word of the env's text whole and decodes it exactly."""
    texts = [text for seed in _TOKENIZER_SEEDS for text in esc.corpus(esc.EscalationEnv(seed=seed))]
    return train_tokenizer(texts, _SPLIT_PATTERN, _TURN_TOKENS, CHAT_TEMPLATE)


def train_tokenizer(
    texts: Sequence[str], split_pattern: str, added: Sequence[str], chat_template: str
) -> PreTrainedTokenizerBase:
    """A BPE tokenizer trained on `texts`, split by `split_pattern`, with the tokens `added`
    whole (the chat template's tags) and `chat_template`."""
    import string

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(split_pattern), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # The vocabulary is large enough that every piece of the corpus merges into one token; the
    # printable alphabet lets unseen words fall back to characters instead of <unk>.
    trainer = trainers.BpeTrainer(
        vocab_size=100_000,
        min_frequency=1,
        special_tokens=[PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=sorted(set(string.printable) - set("\r\x0b\x0c")),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,  # would eat the spaces before punctuation
    )


def fresh_model(tokenizer: PreTrainedTokenizerBase, recipe: TinyRecipe) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_positions,
        initializer_range=recipe.init_std,
        tie_word_embeddings=True,  # copying a listed id is easiest when ids read and write alike
        **special_ids,
    )
    model = AutoModelForCausalLM.from_config(config)
    _init_tool_embeddings(model, _tool_token_ids(tokenizer), recipe)
    model.generation_config = GenerationConfig(**special_ids)
    return model


def _init_tool_embeddings(model: PreTrainedModel, tool_ids: list[int], recipe: TinyRecipe) -> None:
    import torch

    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        if recipe.id_orthogonal_init:
            # Orthogonal ids don't interfere when copied: naming one doesn't boost another.
            block = torch.empty(len(tool_ids), recipe.hidden_size)
            torch.nn.init.orthogonal_(block, gain=recipe.init_std * recipe.hidden_size**0.5)
            embeddings[tool_ids] = block
        # A direction all ids share: attention can find "the ids" at once instead of first
        # discovering that 64 random embeddings form a class.
        shared = torch.randn(recipe.hidden_size) * recipe.init_std * recipe.id_type_init
        embeddings[tool_ids] += shared


def _chat(tokenizer: PreTrainedTokenizerBase, prompt: str, reply: str = "") -> str:
    chat = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return text + reply + (tokenizer.eos_token if reply else "")


def _tool_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return tokenizer.convert_tokens_to_ids([f"tool_{i:02d}" for i in range(esc.TOOL_COUNT)])


def _warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    recipe: TinyRecipe,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Supervised warm-up on the reply format, naming listed tools at random."""
    import torch

    rng = random.Random(recipe.seed)
    env = esc.EscalationEnv()
    queries = [q.text for q in env.train_queries + env.heldout_queries]
    tool_ids = _tool_token_ids(tokenizer)
    opening, closing = tokenizer.convert_tokens_to_ids(["<tool>", "</tool>"])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe))
    model.train()
    progress = WarmUp(recipe, log)
    for step in range(1, recipe.steps + 1):
        n_tools = listing_size(rng, step, recipe)
        batch = max(1, recipe.tokens_per_step // (40 + 9 * n_tools))
        chats, listed = [], torch.zeros(batch, len(tokenizer))
        for row in range(batch):
            ids = rng.sample(range(esc.TOOL_COUNT), n_tools)
            caps = rng.sample(esc.CAPABILITIES, n_tools)
            tools = [esc.Tool(f"tool_{i:02d}", cap) for i, cap in zip(ids, caps, strict=True)]
            prompt = esc.render_prompt(tools, rng.choice(queries))
            # The vote is a random listed tool, never the target: the model must start at chance.
            chats.append(_chat(tokenizer, prompt, esc.reply(rng.choice(tools).id)))
            listed[row, [tool_ids[i] for i in ids]] = 1.0 / n_tools
        rows = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(chats)]
        # Predictions of the reply's four tokens come from the four positions before them.
        starts = [len(r) - 5 for r in rows]
        if any(r[-4] != opening or r[-2:] != [closing, eos] for r in rows):
            raise RuntimeError("the reply did not tokenize as <tool> ID </tool> </assistant>")
        width = max(map(len, rows))
        # Right padding needs no attention mask: causal attention never looks ahead to the pads.
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        positions = torch.tensor(starts)[:, None] + torch.arange(4)
        hidden = model.model(input_ids=input_ids).last_hidden_state
        # Project only the reply positions: the vocabulary head is the costliest layer otherwise.
        picked = hidden.gather(1, positions[:, :, None].expand(-1, -1, hidden.shape[-1]))
        logp = model.lm_head(picked).log_softmax(-1)
        hard = -(logp[:, 0, opening] + logp[:, 2, closing] + logp[:, 3, eos])
        # The id position's target is uniform over the listed ids: the expectation of a random
        # pick, with far less variance than one sampled id.
        soft = -(logp[:, 1] * listed).sum(-1)
        loss = (hard + soft).mean()
        with torch.no_grad():
            mass = (logp[:, 1].exp() * (listed > 0)).sum(-1).mean().item()
        progress.step(step, loss, mass, model, optimizer, schedule)
    return progress.stats()


class WarmUp:
    """A warm-up's optimizer step, running mass on the listed ids, log lines and stats."""

    def __init__(self, recipe: TinyRecipe, log: Callable[[str], None]) -> None:
        self.recipe, self.log = recipe, log
        self.started, self.listed_mass, self.loss = time.perf_counter(), 0.0, math.nan

    def step(
        self, step: int, loss: Any, mass: float, model: Any, optimizer: Any, schedule: Any
    ) -> None:
        """Back-propagate `loss`, clip, step the optimizer and schedule; note `mass` (the
        probability the id positions put on the listed ids)."""
        import torch

        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        self.loss = loss.item()
        self.listed_mass = mass if step == 1 else 0.95 * self.listed_mass + 0.05 * mass
        if step % 100 == 0 or step == self.recipe.steps:
            self.log(
                f"warm-up step {step}/{self.recipe.steps}: loss {self.loss:.3f}, "
                f"mass on listed ids {self.listed_mass:.2f}, "
                f"{time.perf_counter() - self.started:.0f}s"
            )

    def stats(self) -> dict[str, Any]:
        return {
            "warmup_steps": self.recipe.steps,
            "warmup_seconds": round(time.perf_counter() - self.started, 1),
            "warmup_final_loss": round(self.loss, 4),
            "warmup_listed_mass": round(self.listed_mass, 4),
        }


def listing_size(rng: random.Random, step: int, recipe: TinyRecipe) -> int:
    # Log-uniform sizes up to a cap that grows over the curriculum: short listings teach copying
    # fast and cheaply, and only a listing much shorter than 64 says which ids *not* to name.
    ramp = min(1.0, step / max(1, recipe.curriculum_steps))
    cap = recipe.first_max_tools * (recipe.max_tools / recipe.first_max_tools) ** ramp
    if rng.random() < recipe.short_share:
        cap = min(cap, recipe.short_max_tools)
    return round(2 ** rng.uniform(math.log2(recipe.min_tools), math.log2(cap)))


def lr_factor(step: int, recipe: TinyRecipe) -> float:
    if step < recipe.lr_warmup_steps:
        return (step + 1) / recipe.lr_warmup_steps
    progress = (step - recipe.lr_warmup_steps) / max(1, recipe.steps - recipe.lr_warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def evaluate_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    variant: str,
    n: int,
    k: int = 4,
    seed: int = 0,
    batch_size: int = 32,
) -> dict[str, float]:
    """Sample replies at temperature 1 for env prompts: well-formed, listed and correct shares."""
    import torch

    examples = []
    for env_seed in range(n):  # a fresh id permutation per prompt, every query in turn
        env = esc.EscalationEnv(seed=env_seed, variant=variant, k=k)
        queries = env.train_queries + env.heldout_queries
        examples.append(env.example(queries[env_seed % len(queries)]))
    torch.manual_seed(seed)
    replies = []
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo : lo + batch_size]
        replies += sample_replies(model, tokenizer, [e.prompt for e in chunk])
    votes = [esc.parse_vote(r) for r in replies]
    count = len(examples)
    return {
        "well_formed": sum(v is not None for v in votes) / count,
        "listed": sum(v in e.tool_ids for v, e in zip(votes, examples, strict=True)) / count,
        "accuracy": sum(v == e.target for v, e in zip(votes, examples, strict=True)) / count,
    }


def sample_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int = 8,
) -> list[str]:
    """One reply per user prompt, sampled at temperature 1 and decoded as TRL decodes them."""
    import torch

    chats = [_chat(tokenizer, p) for p in prompts]
    inputs = tokenizer(chats, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
        )
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
