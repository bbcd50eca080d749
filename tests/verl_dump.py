"""verl's own rollout-dump code, for tests: `RayPPOTrainer._dump_generations` and its helpers,
taken from the installed verl's source (`pip install --no-deps verl`, see the Makefile: its
trainer module imports Ray, torch and more at import, and these methods need only json, os and a
thread pool), the older `_dump_generations` (verl 0.4, no `gts`) pinned below, and its file
logger (`FileLogger`, verl/utils/tracking.py: os and orjson)."""

from __future__ import annotations

import ast
import json
import os
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import pytest

SOURCE = "verl/trainer/ppo/ray_trainer.py"
METHODS = (
    "_write_generations",
    "_dump_generations",
    "_init_dump_executor",
    "_shutdown_dump_executor",
)

# verl v0.4.1, verl/trainer/ppo/ray_trainer.py, RayPPOTrainer._dump_generations, as released (the
# dump before verl added `gts`, written synchronously in one write).
OLD_DUMP = '''
def _dump_generations(self, inputs, outputs, scores, reward_extra_infos_dict, dump_path):
    """Dump rollout/validation samples as JSONL."""
    os.makedirs(dump_path, exist_ok=True)
    filename = os.path.join(dump_path, f"{self.global_steps}.jsonl")

    n = len(inputs)
    base_data = {
        "input": inputs,
        "output": outputs,
        "score": scores,
        "step": [self.global_steps] * n,
    }

    for k, v in reward_extra_infos_dict.items():
        if len(v) == n:
            base_data[k] = v

    lines = []
    for i in range(n):
        entry = {k: v[i] for k, v in base_data.items()}
        lines.append(json.dumps(entry, ensure_ascii=False))

    with open(filename, "w") as f:
        f.write("\\n".join(lines) + "\\n")

    print(f"Dumped generations to {filename}")
'''


def source_path() -> Path:
    """The installed verl's trainer source (the test fails, saying how to install it, without)."""
    try:
        return Path(str(distribution("verl").locate_file(SOURCE)))
    except PackageNotFoundError:
        pytest.fail("verl is needed for these tests: pip install --no-deps -c constraints.txt verl")


def _methods(text: str, filename: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The named functions (class methods or module functions) of a source text, compiled with
    the names they use."""
    tree = ast.parse(text)
    found: list[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.Module):
            found += [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found if isinstance(n, ast.FunctionDef)}
    assert not missing, f"{filename} no longer defines {sorted(missing)}"
    namespace: dict[str, Any] = {"json": json, "os": os, "ThreadPoolExecutor": ThreadPoolExecutor}
    exec(compile(ast.Module(body=found, type_ignores=[]), filename, "exec"), namespace)
    return {name: namespace[name] for name in names}


class _Host:
    global_steps = 0


def trainer() -> Any:
    """An object carrying verl's own dump methods, as RayPPOTrainer has them: set `global_steps`,
    call `_dump_generations(...)` (written on verl's background thread), and
    `_shutdown_dump_executor()` to wait for the writes."""
    path = source_path()
    methods = _methods(path.read_text(encoding="utf-8"), str(path), METHODS)
    host = type("VerlTrainer", (_Host,), methods)()
    host._init_dump_executor()
    return host


def old_trainer() -> Any:
    """An object carrying verl 0.4's `_dump_generations` (no `gts`, written at once)."""
    methods = _methods(OLD_DUMP, "verl-0.4.1/ray_trainer.py", ("_dump_generations",))
    return type("OldVerlTrainer", (_Host,), methods)()


def dump(
    host: Any,
    folder: Path,
    step: int,
    inputs: list[str],
    outputs: list[str],
    scores: list[float],
    extra: dict[str, list[Any]] | None = None,
    gts: list[Any] | None = None,
) -> Path:
    """Call verl's `_dump_generations` for one step, as its trainer does; the file it writes."""
    host.global_steps = step
    kwargs: dict[str, Any] = {
        "inputs": inputs,
        "outputs": outputs,
        "scores": scores,
        "reward_extra_infos_dict": extra or {},
        "dump_path": str(folder),
    }
    if gts is not None:
        kwargs["gts"] = gts
    host._dump_generations(**kwargs)
    if hasattr(host, "_dump_futures"):  # verl 0.9 writes on a thread: wait for this write
        for future in list(host._dump_futures):
            future.result()
    return folder / f"{step}.jsonl"


def file_logger(path: Path) -> Any:
    """verl's own FileLogger class from the installed verl's source, writing to `path` as it
    does with VERL_FILE_LOGGER_PATH set: `.log(data, step)` a line a call, `.finish()`."""
    import orjson

    source = Path(str(distribution("verl").locate_file("verl/utils/tracking.py")))
    tree = ast.parse(source.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FileLogger")
    namespace: dict[str, Any] = {"os": os, "orjson": orjson}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(source), "exec"), namespace)
    before = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        return namespace["FileLogger"]("project", "experiment")
    finally:
        if before is None:
            del os.environ["VERL_FILE_LOGGER_PATH"]
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = before


def grpo_advantages(scores: list[float], groups: list[int]) -> list[float]:
    """Each sample's advantage by verl's own `compute_grpo_outcome_advantage` (core_algos.py, its
    registering decorator left off), on torch as verl runs it."""
    import numpy as np
    import torch

    path = Path(str(distribution("verl").locate_file("verl/trainer/ppo/core_algos.py")))
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "compute_grpo_outcome_advantage"
    )
    node.decorator_list = []
    namespace: dict[str, Any] = {
        "torch": torch,
        "np": np,
        "defaultdict": __import__("collections").defaultdict,
        "Optional": __import__("typing").Optional,
        "AlgoConfig": object,  # only an annotation
    }
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    rewards = torch.tensor(scores, dtype=torch.float32)[:, None]
    advantages, _ = namespace["compute_grpo_outcome_advantage"](
        token_level_rewards=rewards,
        response_mask=torch.ones_like(rewards),
        index=np.array([str(g) for g in groups], dtype=object),
    )
    return [float(a) for a in advantages[:, 0]]
