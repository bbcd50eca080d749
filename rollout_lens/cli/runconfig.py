"""`rollout-lens train`'s run options, derived field by field from RunConfig.

RunConfig (server/core/runconfig.py) is the one description of a run: its fields give each
option's name, type, choices, range, default and help text, so a field added there is an option
here with nothing retyped. argparse only parses the text into the field's type (a bad number or
choice fails there, naming the option); every other rule is RunConfig's and its message is the
one the form and the JSON API give.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

# Short spellings the command has always accepted, kept beside the derived `--field-name`.
ALIASES: Mapping[str, tuple[str, ...]] = {
    "learning_rate": ("--lr",),
    "sft_learning_rate": ("--sft-lr",),
}
# A list field is one option given once per item: `--control-token A --control-token B`.
LIST_OPTION_NAMES: Mapping[str, str] = {"control_tokens": "--control-token"}
_METAVARS: Mapping[type, str] = {int: "N", float: "X", str: "TEXT"}


class UnsupportedField(TypeError):
    """A config field whose type has no command-line spelling here (add one, or an alias)."""


def add_config_options(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One option per field of `model`, in field order, each defaulting to None (not given):
    the config's own defaults and its rules between fields (a multi-turn run's budget) apply
    to what is left out."""
    group = parser.add_argument_group(
        "run options", f"the fields of {model.__name__}; each left out takes its default"
    )
    for name, field in model.model_fields.items():
        group.add_argument(
            *_option_strings(name, field),
            **_option_spec(name, field, getattr(model, "recipe_fields", ())),
        )


def config_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The fields given on the command line, ready for `model(**values)`."""
    given = vars(args)
    return {k: given[k] for k in model.model_fields if given.get(k) is not None}


def _option_strings(name: str, field: FieldInfo) -> list[str]:
    if _list_item(field.annotation) is not None:
        return [LIST_OPTION_NAMES.get(name, "--" + name.replace("_", "-"))]
    return ["--" + name.replace("_", "-"), *ALIASES.get(name, ())]


def _option_spec(name: str, field: FieldInfo, recipe: tuple[str, ...] = ()) -> dict[str, Any]:
    annotation = _without_none(field.annotation)
    spec: dict[str, Any] = {"dest": name, "default": None}
    notes: list[str] = []
    item = _list_item(annotation)
    if item is not None:
        spec |= {"action": "append", "type": _scalar(name, item), "metavar": "TOKEN"}
        notes.append("repeat for each")
    elif typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        spec |= {"choices": choices, "type": _scalar(name, type(choices[0]))}
    else:
        scalar = _scalar(name, annotation)
        spec |= {"type": scalar, "metavar": _METAVARS[scalar]}
        bounds = _bounds(field)
        if bounds:
            notes.append(bounds)
    # a default that depends on other fields (the model, the turns) is said by the help text
    if field.default is not None and field.default != "" and name not in recipe:
        notes.append(f"default: {field.default}")
    text = (field.description or "").rstrip(".")
    if notes:
        text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes)
    text = f"{text}." if text else text
    spec["help"] = text.replace("%", "%%")  # argparse formats help with %
    return spec


def _without_none(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _list_item(annotation: Any) -> Any:
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        # list[Annotated[str, ...]]: the constraint is RunConfig's to check
        return typing.get_args(item)[0] if typing.get_origin(item) is typing.Annotated else item
    return None


def _scalar(name: str, annotation: Any) -> type:
    if annotation in _METAVARS:
        return typing.cast(type, annotation)
    raise UnsupportedField(f"RunConfig field {name!r} ({annotation!r}) has no command-line option")


def _bounds(field: FieldInfo) -> str:
    """The field's range as text: `1 to 64`, `above 0, at most 1.0`."""
    words = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
    found = {
        key: getattr(rule, key)
        for rule in field.metadata
        for key in words
        if isinstance(rule, annotated_types.BaseMetadata) and hasattr(rule, key)
    }
    if found.keys() == {"ge", "le"}:
        return f"{found['ge']} to {found['le']}"
    return ", ".join(f"{words[key]} {value}" for key, value in found.items())
