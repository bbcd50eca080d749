"""The launch form's data: field specs from RunConfig, and parsing into validated configs.

Pure (no request, no database): the form page, its POST handler and `POST /api/runs` share it, and
RunConfig (server.core.runconfig) is the only validation there is. The presets the form offers
are in server.core.presets.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import annotated_types
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.presets import PRESET_GROUPS, PRESETS, SEED_VERIFIER, Preset
from rollout_lens.server.core.runconfig import (
    MAX_NAME,
    PRETRAINED,
    RECIPE_FIELDS,
    RunConfig,
    recipe_defaults,
)
from rollout_lens.server.core.task_vocab import SFT_MODES, TINY, TURNS, VARIANTS, VERIFIERS

FORM_ERROR = "__all__"  # errors that belong to no single field

# --- field specs --------------------------------------------------------------------------------

GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "task",
        "Task",
        (
            "name",
            "turns",
            "variant",
            "k",
            "episodes",
            "max_calls",
            "verifier",
            "verifier_noise",
            "seed",
        ),
    ),
    ("model", "Model", ("model", "max_completion_tokens", "temperature", "control_tokens")),
    (
        "grpo",
        "GRPO",
        ("steps", "group_size", "prompts_per_step", "learning_rate", "kl_coef", "num_iterations"),
    ),
    (
        "supervision",
        "Supervision",
        ("supervision", "supervised_per_group", "sft_every", "sft_steps", "sft_learning_rate"),
    ),
    ("evaluation", "Evaluation and storage", ("eval_every", "keep_tokens_every")),
)
LABELS = {
    "name": "Name",
    "turns": "Turns",
    "variant": "Variant",
    "episodes": "Episodes",
    "max_calls": "Tool calls per rollout",
    "k": "Shortlist size k",
    "verifier": "Verifier",
    "verifier_noise": "Verifier noise",
    "seed": "Seed",
    "model": "Model",
    "max_completion_tokens": "Max completion tokens",
    "temperature": "Temperature",
    "control_tokens": "Control tokens",
    "steps": "Steps",
    "group_size": "Group size G",
    "prompts_per_step": "Prompts per step",
    "learning_rate": "Learning rate",
    "kl_coef": "KL coefficient β",
    "num_iterations": "Updates per generation μ",
    "supervision": "Supervisory signal",
    "supervised_per_group": "Supervised per group",
    "sft_every": "SFT every",
    "sft_steps": "SFT steps",
    "sft_learning_rate": "SFT learning rate",
    "eval_every": "Evaluate every",
    "keep_tokens_every": "Keep token data every",
}
# A field that matters only for some values of another (the form dims it otherwise).
RELEVANT_WHEN = {
    "k": ("variant", ("patched",)),
    "episodes": ("turns", ("multi",)),
    "max_calls": ("turns", ("multi",)),
    "verifier_noise": ("verifier", ("noisy", "judge")),
    "supervised_per_group": ("supervision", ("offpolicy", "hint")),
    "sft_every": ("supervision", ("interleaved_sft",)),
    "sft_steps": ("supervision", SFT_MODES),
    "sft_learning_rate": ("supervision", SFT_MODES),
}
CHOICES = {"verifier": tuple(VERIFIERS)}
LIST_FIELDS = ("control_tokens",)


def _bounds(info: FieldInfo) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            out["min"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            out["above"] = item.gt
        elif isinstance(item, annotated_types.Le):
            out["max"] = item.le
        elif isinstance(item, annotated_types.MaxLen):
            out["max_length"] = item.max_length
    return out


def _kind(info: FieldInfo) -> tuple[str, tuple[str, ...]]:
    """(input kind, options): select for Literal types, number, list or text otherwise."""
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return "select", tuple(str(a) for a in typing.get_args(annotation))
    if annotation is bool:
        return "select", ("true", "false")
    if annotation is int:
        return "int", ()
    if annotation is float:
        return "float", ()
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if args and typing.get_origin(args[0]) is list:
            return "list", ()
    return "text", ()


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def _range_text(bounds: Mapping[str, Any]) -> str:
    low = f"> {_number(bounds['above'])}" if "above" in bounds else None
    if "min" in bounds:
        low = f"≥ {_number(bounds['min'])}"
    high = f"≤ {_number(bounds['max'])}" if "max" in bounds else None
    return ", ".join(p for p in (low, high) if p)


def display(value: Any) -> str:
    """A config value as the form shows it (and parses it back)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def _field_specs(values: Mapping[str, str], errors: Mapping[str, str]) -> list[dict[str, Any]]:
    """The form's groups of fields, each with its label, help, current text and error.

    Every RunConfig field appears: fields no group names go to an "Other" group, so a field the
    trainer gains shows up on the form without a template change.
    """
    fields = RunConfig.model_fields
    placed = {name for _, _, names in GROUPS for name in names}
    groups = [(gid, title, [n for n in names if n in fields]) for gid, title, names in GROUPS]
    extra = [n for n in fields if n not in placed]
    if extra:
        groups.append(("other", "Other", extra))
    out = []
    for gid, title, names in groups:
        specs = []
        for name in names:
            info = fields[name]
            kind, options = _kind(info)
            options = CHOICES.get(name, options)
            bounds = _bounds(info)
            when = RELEVANT_WHEN.get(name)
            specs.append(
                {
                    "name": name,
                    "label": label(name),
                    "help": info.description or "",
                    "range": _range_text(bounds),
                    "kind": "select" if options else kind,
                    "options": options,
                    "min": bounds.get("min", bounds.get("above")),
                    "max": bounds.get("max"),
                    "value": values.get(name, ""),
                    "default": defaults()[name] if name != "name" else "",
                    "default_by_recipe": DEFAULTS_BY_RECIPE.get(name),
                    "error": errors.get(name),
                    "when": {"field": when[0], "values": list(when[1])} if when else None,
                }
            )
        out.append({"id": gid, "title": title, "fields": specs})
    return out


# --- values, configs, errors --------------------------------------------------------------------


# Where the form starts from RunConfig's defaults: the verifier every preset trains on (the
# API and the CLI keep RunConfig's "exact").
FORM_DEFAULTS: dict[str, Any] = dict(SEED_VERIFIER)
# Defaults that depend on the model and the turns (RunConfig's recipe_defaults), keyed
# "tiny/single", "pretrained/multi"…: the form shows and swaps them as those fields change.
DEFAULTS_BY_RECIPE: dict[str, dict[str, str]] = {
    name: {
        f"{kind}/{turns}": display(recipe_defaults(model, turns)[name])
        for kind, model in ((TINY, TINY), (PRETRAINED, "any other model"))
        for turns in TURNS
    }
    for name in RECIPE_FIELDS
}


def defaults() -> dict[str, str]:
    """The form's defaults as text: RunConfig's, with FORM_DEFAULTS on top (name empty: derived
    from the recipe)."""
    out = {}
    for name, info in RunConfig.model_fields.items():
        out[name] = display(FORM_DEFAULTS.get(name, info.get_default(call_default_factory=True)))
    out["name"] = ""
    return out


def _preset_values(preset: Preset) -> dict[str, str]:
    """The form text of a preset: defaults, its base, then its first run's values."""
    return defaults() | {k: display(v) for k, v in preset.base.items()}


def config_values(config: Mapping[str, Any]) -> dict[str, str]:
    """Form text of a run's launch config (for Clone): unknown keys dropped, a derived name cleared
    so that it is derived again from whatever the user changes."""
    known = {k: v for k, v in config.items() if k in RunConfig.model_fields}
    values = defaults() | {k: display(v) for k, v in known.items()}
    try:
        derived = RunConfig.model_validate(known | {"name": ""}).name
    except ValidationError:
        derived = None
    if known.get("name") == derived:
        values["name"] = ""
    return values


def parse_form(form: Mapping[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """(the text as typed, for redisplay; the raw values for RunConfig) from a submitted form.

    Only RunConfig's fields are read; empty list fields and other empty optional fields mean "the
    default" (None), every other value goes to RunConfig as typed, so its messages are the ones
    the user sees.
    """
    typed: dict[str, str] = {}
    raw: dict[str, Any] = {}
    for name in RunConfig.model_fields:
        if name not in form:
            continue
        text = str(form[name])
        typed[name] = text
        if name in LIST_FIELDS:
            items = [t for t in re.split(r"[,\s]+", text.strip()) if t]
            raw[name] = items or None
        elif not text.strip() and RunConfig.model_fields[name].default is None:
            raw[name] = None  # an optional field left empty: its default (e.g. keep every step)
        else:
            raw[name] = text.strip()
    return typed, raw


class LaunchInvalid(Exception):
    """A launch request that fails validation: field → message (FORM_ERROR for the rest)."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def _field_errors(exc: ValidationError) -> dict[str, str]:
    """A message per field, in the form's words: its label and what it must be ("Group size G
    must be at least 2"), not its id and pydantic's phrasing. Errors of the model as a whole
    (e.g. supervised_per_group vs group_size) go to the field their message names first."""
    out: dict[str, str] = {}
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        message = str(err["msg"]).removeprefix("Value error, ")
        name = loc[0] if loc else _named_field(message)
        if loc and name not in RunConfig.model_fields and len(loc) == 1:
            message = f"{name} is not a setting of a run"
        elif loc and err["type"] != "value_error":
            message = f"{label(name)} {_requirement(err)}"
        elif loc:  # a validator's message on one field
            message = f"{label(name)}: {_with_labels(message)}"
        else:
            message = _with_labels(message)
            message = message[:1].upper() + message[1:]
        out.setdefault(name, message)
    return out


def label(name: str) -> str:
    """A field's label on the form (its id made readable for a field the form does not name)."""
    return LABELS.get(name, name.replace("_", " ").capitalize())


def _requirement(err: Any) -> str:
    """What a value must be, from pydantic's error type and its context."""
    kind, ctx = err["type"], err.get("ctx") or {}
    words: dict[str, Callable[[], str]] = {
        "greater_than_equal": lambda: f"must be at least {_number(ctx['ge'])}",
        "less_than_equal": lambda: f"must be at most {_number(ctx['le'])}",
        "greater_than": lambda: f"must be greater than {_number(ctx['gt'])}",
        "less_than": lambda: f"must be less than {_number(ctx['lt'])}",
        "int_parsing": lambda: "must be a whole number",
        "int_from_float": lambda: "must be a whole number",
        "float_parsing": lambda: "must be a number",
        "string_too_long": lambda: f"must be at most {ctx['max_length']} characters",
        "too_long": lambda: f"must have at most {ctx['max_length']} items",
        "string_too_short": lambda: f"must have at least {ctx['min_length']} character",
        "list_type": lambda: "must be a list of tokens",
        "extra_forbidden": lambda: "is not a setting of a run",
    }
    if kind in words:
        return words[kind]()
    text = str(err["msg"])  # e.g. literal_error: "Input should be 'leaky' or 'patched'"
    return (
        "must be" + text.removeprefix("Input should be")
        if text.startswith("Input should be")
        else text
    )


def _with_labels(message: str) -> str:
    """A validator's message with the field ids it names replaced by their labels."""
    for name in sorted(RunConfig.model_fields, key=len, reverse=True):
        if "_" in name:  # plain words (steps, seed) also occur as words in the prose
            message = re.sub(rf"\b{name}\b", label(name), message)
    return message


def _named_field(message: str) -> str:
    found = [(message.find(n), n) for n in RunConfig.model_fields if n in message]
    return min(found)[1] if found else FORM_ERROR


def _all_errors(data: Mapping[str, Any], exc: ValidationError) -> dict[str, str]:
    """Field errors, plus the errors between fields that pydantic checks only once every field
    is valid (found again with the bad fields at their defaults): all messages in one round."""
    found = _field_errors(exc)
    if FORM_ERROR not in found:
        try:
            RunConfig.model_validate({k: v for k, v in data.items() if k not in found})
        except ValidationError as again:
            for name, message in _field_errors(again).items():
                found.setdefault(name, message)
    return found


def build_configs(preset: Preset | None, values: Mapping[str, Any]) -> list[RunConfig]:
    """One validated RunConfig per run of `preset` (or one for no preset) with `values` on top;
    LaunchInvalid with every field's message if any run's config is invalid."""
    if preset is None:
        preset = Preset("custom", "Custom", "")
    clash = [n for n in preset.varies if n in values and values[n] not in ("", None)]
    if clash:
        shown = ", ".join(preset.run_label({n: r[n] for n in clash}) for r in preset.runs)
        raise LaunchInvalid(
            {n: f"the preset {preset.name!r} sets {n} per run ({shown})" for n in clash}
        )
    configs: list[RunConfig] = []
    errors: dict[str, str] = {}
    for run in preset.runs:
        data = dict(preset.base) | dict(values) | dict(run)
        try:
            config = RunConfig.model_validate(data)
        except ValidationError as exc:
            for name, message in _all_errors(data, exc).items():
                errors.setdefault(name, message)
            continue
        label = preset.run_label(run)
        if label and label not in config.name:  # "leaky (64 tools)" already says leaky
            config = config.model_copy(update={"name": f"{config.name} · {label}"[:MAX_NAME]})
        configs.append(config)
    if errors:
        raise LaunchInvalid(errors)
    return configs


def configs_from_request(body: Mapping[str, Any]) -> list[RunConfig]:
    """The configs a `POST /api/runs` body asks for: RunConfig fields, or `preset` plus fields
    that override it in each of its runs; LaunchInvalid with every field's message otherwise."""
    values = dict(body)
    preset_name = values.pop("preset", None)
    preset = None
    if preset_name is not None:
        preset = PRESETS.get(str(preset_name))
        if preset is None:
            known = ", ".join(PRESETS)
            raise LaunchInvalid(
                {"preset": f"unknown preset {preset_name!r}; choose one of {known}"}
            )
    return build_configs(preset, values)


def submitted_preset(form: Mapping[str, str]) -> Preset | None:
    """The preset a submitted form launches: only one of several runs; a one-run preset only
    filled the form, so what was typed is the config."""
    preset = PRESETS.get(str(form.get("preset", "")))
    return preset if preset is not None and preset.compares else None


def presets_data() -> dict[str, Any]:
    """The launch form as data (GET /api/presets): its presets, and every RunConfig field with
    its default, help and bounds."""
    fields = [
        {k: v for k, v in spec.items() if k not in ("value", "error")}
        for group in _field_specs({}, {})
        for spec in group["fields"]
    ]
    return {"presets": [p.as_dict() for p in PRESETS.values()], "fields": fields}


# --- the form page ------------------------------------------------------------------------------


def _columns_config(run: Mapping[str, Any]) -> dict[str, Any]:
    """What a run without a launch config (a user's own script) says about its recipe."""
    out = {"model": run["model"], "steps": run["total_steps"], "group_size": run["group_size"]}
    out |= {"prompts_per_step": run["prompts_per_step"], "seed": run["seed"]}
    if run["variant"] in VARIANTS:
        out["variant"] = run["variant"]
    if run["k"] is not None:
        out["k"] = run["k"]
    return out


def start_form(
    preset_name: str = "",
    source: Mapping[str, Any] | None = None,
    builds: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The form page's context as first opened: the form's defaults, a preset's values, or the
    config of the run `source` (a run_dict, for Clone). InvalidInput for an unknown preset."""
    if source is not None:
        # An external run's config is its own trainer's (a GRPOConfig, say), not a RunConfig.
        launched = bool(source["config"]) and not source.get("external")
        clone = {"id": source["id"], "name": source["name"], "has_config": launched}
        values = config_values(source["config"] if launched else _columns_config(source))
        return form_context(values, clone=clone, builds=builds)
    if preset_name:
        preset = PRESETS.get(preset_name)
        if preset is None:
            raise InvalidInput(f"no preset {preset_name!r}; choose one of {', '.join(PRESETS)}")
        return form_context(_preset_values(preset), preset=preset, builds=builds)
    return form_context(defaults(), builds=builds)


def form_context(
    values: Mapping[str, str],
    *,
    preset: Preset | None = None,
    clone: dict[str, Any] | None = None,
    errors: Mapping[str, str] | None = None,
    broker_error: str | None = None,
    builds: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """new_run.html's context: `values` as typed, each error next to its field, and the model
    builds a launch would wait for (model_builds)."""
    errors = errors or {}
    return {
        "builds": dict(builds or {}),
        "groups": _field_specs(defaults() | dict(values), errors),
        "presets": PRESETS,
        "preset_groups": PRESET_GROUPS,
        "preset": preset,
        "clone": clone,
        "errors": errors,
        "form_error": errors.get(FORM_ERROR),
        "broker_error": broker_error,
    }
