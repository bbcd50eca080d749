"""The tiny models as the package ships them: installed into the cache instead of built, when the
packaged build's recipe hash is the one this install would build (same recipe, sources and
torch/transformers/tokenizers versions); otherwise built as before.

Kept apart from tiny_model and multiturn_model on purpose: their source text is part of their
recipe hash, so code that only installs a build must not live there.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lens.trainer.builders import multiturn_model, tiny_model

import rollout_lens

# rollout_lens/models/<name>/: the files `make prebuilt` writes and the wheel carries.
PACKAGED = Path(rollout_lens.__file__).resolve().parent / "models"


@dataclass(frozen=True)
class Kind:
    """One tiny model: its packaged folder name, its label, where the cache keeps it, its build."""

    name: str
    label: str
    recipe_hash: str
    cache_dir: Callable[[Path], Path]
    build: Callable[..., dict[str, Any]]
    steps: int


TINY = Kind(
    "tiny",
    "tiny model",
    tiny_model.RECIPE_HASH,
    tiny_model.tiny_model_dir,
    tiny_model.build_tiny_model,
    tiny_model.RECIPE.steps,
)
MULTITURN = Kind(
    "tiny-multiturn",
    "multi-turn model",
    multiturn_model.RECIPE_HASH,
    multiturn_model.model_dir,
    multiturn_model.build_multiturn_model,
    multiturn_model.RECIPE.steps,
)
KINDS = (TINY, MULTITURN)


def packaged_dir(kind: Kind) -> Path:
    """Where the package keeps `kind`'s prebuilt files."""
    return PACKAGED / kind.name


def packaged_hash(kind: Kind) -> str | None:
    """The recipe hash the packaged build was made for (None: nothing packaged)."""
    stats = packaged_dir(kind) / tiny_model.BUILD_STATS_FILE
    if not stats.is_file():
        return None
    return str(json.loads(stats.read_text()).get("recipe_hash") or "") or None


def is_ready(kind: Kind, cache_dir: Path) -> bool:
    """Whether the cache already holds `kind` for this install's recipe."""
    return (kind.cache_dir(cache_dir) / tiny_model.BUILD_STATS_FILE).is_file()


def will_build(kind: Kind, cache_dir: Path) -> bool:
    """Whether ensuring `kind` means training it (minutes), not finding or copying it."""
    return not is_ready(kind, cache_dir) and packaged_hash(kind) != kind.recipe_hash


def ensure(kind: Kind, cache_dir: Path, *, log: Callable[[str], None] = print) -> Path:
    """`kind`'s folder in the cache: there already, copied from the package when its recipe hash
    matches, else built (once across processes: tiny_model.ensure_built's lock and rename)."""

    final = kind.cache_dir(cache_dir)

    def install(out: Path) -> None:
        found = packaged_hash(kind)
        if found == kind.recipe_hash:
            for item in packaged_dir(kind).iterdir():
                if item.is_file():
                    shutil.copyfile(item, out / item.name)
            log(f"{kind.label}: installed the packaged build ({found})")
            return
        why = "none packaged" if found is None else f"the packaged one is {found}"
        log(f"{kind.label}: building recipe {kind.recipe_hash} ({why}); this takes a few minutes")
        # The build names its staging folder, renamed into place when done: print where it stays.
        kind.build(out, log=lambda line: log(line.replace(str(out), str(final))))

    return tiny_model.ensure_built(final, install)


def ensure_tiny(cache_dir: Path, *, log: Callable[[str], None] = print) -> Path:
    """The single-turn tiny model's folder (see `ensure`)."""
    return ensure(TINY, cache_dir, log=log)


def ensure_multiturn(cache_dir: Path, *, log: Callable[[str], None] = print) -> Path:
    """The multi-turn tiny model's folder (see `ensure`)."""
    return ensure(MULTITURN, cache_dir, log=log)


def _estimate_seconds(kind: Kind) -> float | None:
    """How long building `kind` took when the packaged build was made (one idle core)."""
    stats = packaged_dir(kind) / tiny_model.BUILD_STATS_FILE
    if not stats.is_file():
        return None
    seconds = json.loads(stats.read_text()).get("seconds")
    return float(seconds) if seconds else None


def estimate_text(kind: Kind) -> str:
    """ "about 3 minutes on an idle core" (longer on a busy machine), from the packaged build."""
    seconds = _estimate_seconds(kind)
    if seconds is None:
        return "a few minutes"
    minutes = max(1, round(seconds / 60 + 0.49))
    return f"about {minutes} minute{'s' if minutes > 1 else ''} on an idle core"


def launch_notes(cache_dir: Path, kinds: Mapping[str, Kind] | None = None) -> dict[str, str]:
    """turns → a warning for each tiny model (`kinds`: turns → Kind; default both) that a launch
    would first have to build on this machine; none while the packaged models serve (the usual
    case). What the launch form shows (the CLI's `serve` hands it to the web app, which imports
    nothing from the trainer)."""
    kinds = kinds or {"single": TINY, "multi": MULTITURN}
    out = {}
    for turns, kind in kinds.items():
        if will_build(kind, cache_dir):
            out[turns] = (
                f"The first {'multi-turn' if turns == 'multi' else 'single-turn'} run on this "
                f"machine builds the {kind.label} before its first step "
                f"({estimate_text(kind)}, longer on a busy one); later runs reuse it. "
                "Its page shows the build's progress."
            )
    return out


_WARM_UP = re.compile(r"warm-up step (\d+)/(\d+)")


def build_progress(line: str) -> tuple[int, int] | None:
    """(step, of steps) from a build's warm-up log line; None for its other lines."""
    match = _WARM_UP.search(line)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _write_packaged(kind: Kind, *, log: Callable[[str], None] = print) -> Path:
    """Build `kind` afresh (deterministic: seeded, one thread) into the package's folder."""
    target = packaged_dir(kind)
    staging = target.with_name(f".{kind.name}-staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    kind.build(staging, log=log)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def main() -> None:
    """`make prebuilt`: rebuild every packaged model for this install's recipe hashes."""
    for kind in KINDS:
        print(f"{kind.label}: {_write_packaged(kind)} ({kind.recipe_hash})", flush=True)


if __name__ == "__main__":
    main()
