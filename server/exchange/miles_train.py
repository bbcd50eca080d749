"""miles' train dumps: one file a rank, the trainer's side of a step beside its rollout dump.

miles (radixark/miles at 31f1ca96, slime's fork) writes its rollout dumps as slime does
(server/exchange/slime_import.py) but its train dumps otherwise. With `--dump-details DIR` it
sets `--save-debug-train-data DIR/train_data/{rollout_id}_{rank}.pt` (miles/utils/arguments.py
lines 3183–3187), and every rank's actor, after training on a rollout
(miles/backends/megatron_utils/actor.py line 587, fsdp_utils/actor.py lines 575–576), calls
`save_debug_train_data_for_rank` (miles/utils/train_dump_utils.py lines 24–44):
`torch.save(dict(rollout_id, rank, rollout_data, cp_rank, cp_size, qkv_format), path)`, where
`rollout_data` is the rank's shard of the train data as the actor holds it — columns of one entry
a row: `sample_indices` (each row's `Sample.index` in the rollout dump:
miles/ray/rollout/train_data_conversion.py line 81; a numpy array), `response_lengths`,
`tokens`, `loss_masks`, `rollout_log_probs`, and the trainer's `log_probs` and `advantages`
(tensors over the response), `raw_reward` over the whole batch, ….

A row is joined to its rollout-dump sample by `sample_indices`, as miles' own reader does
(miles/dashboard/dump_reader.py, `DumpReader.load_joined`): ranks of one data-parallel shard
(tensor parallelism) hold the same rows, read once; a pipeline stage that did not compute the
trainer's logprobs has no `log_probs` column and gives none. Context parallelism splits a row's
per-token columns across ranks (`cp_size` > 1): such dumps are refused, not assembled.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange import torch_file

FILE_NAME = re.compile(r"^(\d+)_\d+\.pt$")  # {rollout_id}_{rank}.pt


def _column(columns: dict[str, Any], key: str, rows: int, where: str) -> list[Any] | None:
    """A per-row column as a list (None: not in this rank's dump)."""
    value = columns.get(key)
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        value = list(value)
    if not isinstance(value, list) or len(value) != rows:
        raise InvalidInput(f"{where}: {key} does not hold one entry for each of its {rows} rows")
    return value


def _rank(path: Path) -> tuple[list[int], dict[str, Any]]:
    """One rank's dump: its rows' sample indices and its columns."""
    data = torch_file.load(path)
    columns = data.get("rollout_data") if isinstance(data, dict) else None
    if not isinstance(columns, dict):
        raise InvalidInput(f"{path}: no rollout_data dict: not one of miles' train dumps")
    if data.get("cp_size", 1) != 1:
        raise InvalidInput(
            f"{path}: cp_size {data.get('cp_size')!r}: context-parallel train dumps hold slices "
            "of each response and are not read"
        )
    indices = columns.get("sample_indices")
    listed = indices.tolist() if isinstance(indices, np.ndarray) else indices
    if not isinstance(listed, list) or not all(type(i) is int for i in listed):
        raise InvalidInput(f"{path}: sample_indices is not a list of sample indexes")
    return listed, columns


def rows(paths: list[Path], positions: dict[int, int]) -> dict[int, dict[str, Any]]:
    """Per rollout-dump position (`positions`: Sample.index → position), the trainer's row of
    that sample, {"log_probs", "advantages"}, from the first rank that holds it; InvalidInput
    naming the file for anything not in miles' format."""
    out: dict[int, dict[str, Any]] = {}
    for path in paths:
        indices, columns = _rank(path)
        where = str(path)
        log_probs = _column(columns, "log_probs", len(indices), where)
        advantages = _column(columns, "advantages", len(indices), where)
        if log_probs is None:
            continue  # a pipeline stage that did not compute them
        for row, index in enumerate(indices):
            if index not in positions:
                raise InvalidInput(
                    f"{path} row {row}: sample index {index} is not a sample of the rollout dump"
                )
            out.setdefault(
                positions[index],
                {"log_probs": log_probs[row], "advantages": advantages and advantages[row]},
            )
    return out
