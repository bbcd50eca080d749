"""All SQL of the dashboard's reads: keyword-only functions over a Session (routes → queries), one
module per page:

- runs: the runs list (paged) and what every run page shares (card, version, bounds, live state);
- run_page: chart series, 25-step buckets, alerts;
- step_page: the step viewer (a step's groups overview, one group's rollouts, compare's card);
- compare_page: compare;
- mismatch_page: the mismatch drill-down (a step's or a range's generator vs trainer logprobs);
- prompts: the prompt lens's list of a run's prompts (and its dataset export); prompt_groups:
  its heatmap and a prompt's history; prompt_rollouts: a prompt's rollouts with their
  completions; prompt_compare: the same prompts across runs.

Every read costs the same whatever a run's length (index seeks on (run_id, step), rollups for a
long history, alerts as the recorder wrote them), except compare's charts of runs it has not seen
at their current version (kept by version in the API: server.webapp.http.cache).
"""

from rollout_lens.server.webapp.queries.compare_page import (
    COMPARE_BANDS,
    COMPARE_POINTS,
    Memo,
    compare,
    last_values,
)
from rollout_lens.server.webapp.queries.explorer import RolloutQuery, explore
from rollout_lens.server.webapp.queries.mismatch_page import has_generator_side, mismatch_drill
from rollout_lens.server.webapp.queries.prompt_compare import compare_prompts
from rollout_lens.server.webapp.queries.prompt_groups import heatmap, prompt_history
from rollout_lens.server.webapp.queries.prompt_rollouts import prompt_rollouts
from rollout_lens.server.webapp.queries.prompts import (
    HeatmapQuery,
    PromptQuery,
    export_prompts,
    prompts_page,
)
from rollout_lens.server.webapp.queries.run_page import (
    alerts,
    bucket_means,
    evaluate_alerts,
    known_series,
    series,
)
from rollout_lens.server.webapp.queries.runs import (
    MAX_RUNS_PER_PAGE,
    RUN_SORTS,
    RUNS_PER_PAGE,
    matching_runs,
    run_card,
    run_live,
    run_overview,
    run_version,
    run_versions,
    runs_page,
    series_names,
    warning_counts,
)
from rollout_lens.server.webapp.queries.step_page import (
    GROUP_TABS,
    GROUPS_PER_PAGE,
    JSON_POSITIONS,
    JSON_TEXT_BUDGET,
    JSON_TEXT_CHARS,
    JSON_TOKENS,
    MAX_GROUPS_PER_PAGE,
    MAX_ROLLOUTS_PER_PAGE,
    ROLLOUTS_PER_PAGE,
    disagrees_sql,
    group_detail,
    has_group,
    nearest_kept_step,
    nearest_step,
    resolve_step,
    step_card,
    step_groups,
    step_head,
)

__all__ = [
    "RolloutQuery",
    "explore",
    "has_generator_side",
    "mismatch_drill",
    "HeatmapQuery",
    "PromptQuery",
    "compare_prompts",
    "export_prompts",
    "heatmap",
    "prompt_history",
    "prompt_rollouts",
    "prompts_page",
    "COMPARE_BANDS",
    "GROUPS_PER_PAGE",
    "GROUP_TABS",
    "JSON_POSITIONS",
    "JSON_TEXT_BUDGET",
    "JSON_TEXT_CHARS",
    "JSON_TOKENS",
    "MAX_GROUPS_PER_PAGE",
    "MAX_ROLLOUTS_PER_PAGE",
    "ROLLOUTS_PER_PAGE",
    "COMPARE_POINTS",
    "MAX_RUNS_PER_PAGE",
    "RUNS_PER_PAGE",
    "RUN_SORTS",
    "Memo",
    "alerts",
    "bucket_means",
    "compare",
    "disagrees_sql",
    "group_detail",
    "has_group",
    "evaluate_alerts",
    "known_series",
    "last_values",
    "matching_runs",
    "nearest_kept_step",
    "nearest_step",
    "resolve_step",
    "run_card",
    "run_live",
    "run_overview",
    "run_version",
    "run_versions",
    "runs_page",
    "series",
    "series_names",
    "step_card",
    "step_groups",
    "step_head",
    "warning_counts",
]
