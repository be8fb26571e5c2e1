"""``Targets`` as JSON: what the control plane stores per pipeline and a person edits.

Every key is optional (left out: the default). The document mirrors the dataclasses::

    {"enabled": true, "advisory": false, "predictor": "trend", "gpu_budget": 8,
     "default": {"ttft_s": 0.5, "itl_s": 0.05, "percentile": 90, "min_replicas": 1, "max_replicas": 8},
     "groups": {"prefill": {"ttft_s": 0.3, "max_replicas": 4}},
     "load": {"kv_usage_up": 0.8, ...}, "stability": {"cooldown_s": 60, ...}}

A group's entry in ``groups`` is laid over ``default`` (so ``{"max_replicas": 4}`` keeps the pipeline's
latency targets). ``targets_from_dict`` raises ``SettingsError`` whose ``field`` is the path of the
first problem (``groups.prefill.ttft_s``); unknown keys are refused, so a typo is not silently ignored.
"""

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any, TypeVar

from planner.errors import SettingsError
from planner.settings import ROLES, GroupTargets, LoadThresholds, Role, Stability, Targets

_T = TypeVar("_T")
_TOP = {"enabled", "advisory", "predictor", "gpu_budget", "default", "groups", "load", "stability"}


def targets_from_dict(data: Any) -> Targets:
    """Validate a decoded JSON document into ``Targets``. Raises SettingsError naming the field."""
    if not isinstance(data, Mapping):
        raise SettingsError("must be a JSON object", field="")
    _unknown(data, _TOP, "")
    default_values = _section(data, "default")
    default = _build(GroupTargets, default_values, "default")
    groups: dict[Role, GroupTargets] = {}
    raw_groups = data.get("groups", {})
    if not isinstance(raw_groups, Mapping):
        raise SettingsError("must be an object of group role to targets", field="groups")
    for role, values in raw_groups.items():
        if role not in ROLES:
            raise SettingsError(f"unknown group role {role!r} (one of {', '.join(ROLES)})", field=f"groups.{role}")
        if not isinstance(values, Mapping):
            raise SettingsError("must be an object", field=f"groups.{role}")
        groups[role] = _build(GroupTargets, {**default_values, **values}, f"groups.{role}", only=values)
    enabled = _boolean(data, "enabled", True)
    advisory = _boolean(data, "advisory", False)
    budget = data.get("gpu_budget")
    if budget is not None and not _whole(budget):
        raise SettingsError(f"must be a whole number of GPUs or null, not {budget!r}", field="gpu_budget")
    predictor = data.get("predictor", "trend")
    try:
        return Targets(
            default=default,
            groups=groups,
            gpu_budget=budget,
            enabled=enabled,
            advisory=advisory,
            predictor=predictor,
            load=_build(LoadThresholds, _section(data, "load"), "load"),
            stability=_build(Stability, _section(data, "stability"), "stability"),
        )
    except SettingsError as exc:
        raise SettingsError(exc.message, field=exc.field) from exc


def targets_to_dict(targets: Targets) -> dict[str, Any]:
    """The document ``targets_from_dict`` reads back to equal ``Targets`` (every key written out)."""
    return {
        "enabled": targets.enabled,
        "advisory": targets.advisory,
        "predictor": targets.predictor,
        "gpu_budget": targets.gpu_budget,
        "default": dataclasses.asdict(targets.default),
        "groups": {role: dataclasses.asdict(group) for role, group in targets.groups.items()},
        "load": dataclasses.asdict(targets.load),
        "stability": dataclasses.asdict(targets.stability),
    }


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    values = data.get(name, {})
    if not isinstance(values, Mapping):
        raise SettingsError("must be an object", field=name)
    return values


def _build(cls: type[_T], values: Mapping[str, Any], path: str, *, only: Mapping[str, Any] | None = None) -> _T:
    """``cls(**values)`` with each value's type checked against the field's; ``only``: the keys that were
    written at ``path`` (the rest came from the defaults, checked where they were written)."""
    fields = {field.name: field for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    _unknown(values if only is None else only, set(fields), f"{path}.")
    for name, value in values.items():
        kind = fields[name].type
        args = kind.__args__ if isinstance(kind, types.UnionType) else (kind,)
        where = f"{path}.{name}"
        if value is None:
            if type(None) not in args:
                raise SettingsError("may not be null", field=where)
        elif int in args and float not in args:
            if not _whole(value):
                raise SettingsError(f"must be a whole number, not {value!r}", field=where)
        elif not _number(value):
            raise SettingsError(f"must be a number, not {value!r}", field=where)
    try:
        return cls(**values)
    except SettingsError as exc:
        raise SettingsError(exc.message, field=f"{path}.{exc.field}" if exc.field else path) from exc


def _unknown(data: Mapping[str, Any], known: set[str], prefix: str) -> None:
    for key in data:
        if key not in known:
            raise SettingsError(f"unknown setting (one of {', '.join(sorted(known))})", field=f"{prefix}{key}")


def _boolean(data: Mapping[str, Any], name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise SettingsError(f"must be true or false, not {value!r}", field=name)
    return value


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
