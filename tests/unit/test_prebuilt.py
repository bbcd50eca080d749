"""The packaged tiny models: copied into the cache when their recipe hash matches, else built."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.trainer.builders import prebuilt
from rollout_lens.trainer.builders.tiny_model import BUILD_STATS_FILE


def test_a_matching_packaged_build_is_copied_not_built(tmp_path: Path) -> None:
    lines: list[str] = []
    for kind in prebuilt.KINDS:
        assert prebuilt.will_build(kind, tmp_path) is False
        path = prebuilt.ensure(kind, tmp_path, log=lines.append)
        assert path == kind.cache_dir(tmp_path) and prebuilt.is_ready(kind, tmp_path)
        packaged = prebuilt.packaged_dir(kind)
        assert (path / "model.safetensors").read_bytes() == (
            packaged / "model.safetensors"
        ).read_bytes()
        stats = json.loads((path / BUILD_STATS_FILE).read_text())
        assert stats["recipe_hash"] == kind.recipe_hash
    assert lines == [
        f"tiny model: installed the packaged build ({prebuilt.TINY.recipe_hash})",
        f"multi-turn model: installed the packaged build ({prebuilt.MULTITURN.recipe_hash})",
    ]
    # Found in the cache the second time: nothing logged, nothing copied.
    assert prebuilt.ensure(prebuilt.TINY, tmp_path, log=lines.append)
    assert len(lines) == 2


def test_a_different_recipe_is_built_instead(tmp_path: Path) -> None:
    built: list[Path] = []

    def build(out: Path, *, log: Any) -> dict[str, Any]:
        built.append(out)
        log("warm-up step 100/700: loss 2.5, mass on listed ids 0.4, 10s")
        log(f"model built in 3.0s at {out}")
        (out / BUILD_STATS_FILE).write_text("{}")
        return {}

    # Another torch, say: this install's recipe hash is not the packaged build's.
    kind = dataclasses.replace(prebuilt.TINY, recipe_hash="000000000000", build=build)
    assert prebuilt.will_build(kind, tmp_path)
    lines: list[str] = []
    path = prebuilt.ensure(kind, tmp_path, log=lines.append)
    assert len(built) == 1 and prebuilt.is_ready(kind, tmp_path) and path.is_dir()
    assert lines[0].startswith("tiny model: building recipe 000000000000 (the packaged one is ")
    assert prebuilt.build_progress(lines[1]) == (100, 700)
    # The staging folder the build wrote into is gone: the line names where the model stays.
    assert lines[2] == f"model built in 3.0s at {path}" and path.is_dir()
    assert prebuilt.build_progress("model built in 3.0s") is None


def _quiet(line: str) -> None:
    """A build's log, not shown."""


def _built_here(kind: prebuilt.Kind, build: Any) -> prebuilt.Kind:
    """`kind` as an install whose recipe the package has no build of, built by `build` (the
    real build takes minutes; what is tested is the lock and the rename around it)."""
    return dataclasses.replace(kind, recipe_hash="000000000000", build=build)


@pytest.mark.parametrize("kind", prebuilt.KINDS, ids=lambda k: k.name)
def test_concurrent_ensures_build_once(kind: prebuilt.Kind, tmp_path: Path) -> None:
    built: list[Path] = []

    def build(out: Path, *, log: Any) -> dict[str, Any]:
        built.append(out)
        (out / BUILD_STATS_FILE).write_text("{}")
        return {}

    kind = _built_here(kind, build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(prebuilt.ensure(kind, tmp_path, log=_quiet)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1 and results == [kind.cache_dir(tmp_path)] * 4
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [kind.cache_dir(tmp_path).name]


@pytest.mark.parametrize("kind", prebuilt.KINDS, ids=lambda k: k.name)
def test_a_failed_build_leaves_no_model_behind(kind: prebuilt.Kind, tmp_path: Path) -> None:
    def broken(out: Path, *, log: Any) -> dict[str, Any]:
        (out / "partial").write_text("x")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        prebuilt.ensure(_built_here(kind, broken), tmp_path, log=_quiet)
    assert not any(p.is_dir() for p in tmp_path.iterdir())
    assert not prebuilt.is_ready(kind, tmp_path)
