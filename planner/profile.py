"""A model's measured capacity at its latency targets: what SLA mode sizes groups with.

A profile is data, stored with the model in the control plane and editable there, so it is JSON in and
out and every problem a person could make in it is reported with its field::

    {
      "version": 1,
      "gpus_per_replica": 1,
      "prefill": {"ttft_s": 0.5, "points": [{"isl": 1024, "tokens_per_s": 24000}, ...]},
      "decode": {"itl_s": 0.05, "points": [{"context_tokens": 2048, "tokens_per_s": 3100}, ...]}
    }

``prefill.points``: for prompt lengths, the most prompt tokens per second one replica computes while its
TTFT stays within ``ttft_s``. ``decode.points``: for context lengths (prompt plus the tokens generated so
far), the most output tokens per second one replica produces while its ITL stays within ``itl_s``. Between
points capacity is interpolated linearly; outside them the nearest point's holds (the caller is told).
"""

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from planner.errors import ProfileError

VERSION = 1


@dataclass(frozen=True)
class CapacityCurve:
    """Capacity (tokens per second per replica) against a length in tokens, at one latency target."""

    target_s: float
    lengths: tuple[float, ...]
    tokens_per_s: tuple[float, ...]

    def at(self, length: float) -> float:
        """Capacity at ``length``: interpolated between points, the nearest point's outside them."""
        if length <= self.lengths[0]:
            return self.tokens_per_s[0]
        if length >= self.lengths[-1]:
            return self.tokens_per_s[-1]
        i = bisect.bisect_right(self.lengths, length)
        x0, x1 = self.lengths[i - 1], self.lengths[i]
        y0, y1 = self.tokens_per_s[i - 1], self.tokens_per_s[i]
        return y0 + (y1 - y0) * (length - x0) / (x1 - x0)

    def covers(self, length: float) -> bool:
        """Whether ``length`` is within the measured range."""
        return self.lengths[0] <= length <= self.lengths[-1]


@dataclass(frozen=True)
class Profile:
    """Prefill and decode capacity of one replica (``gpus_per_replica`` GPUs; None: not said)."""

    prefill: CapacityCurve
    decode: CapacityCurve
    gpus_per_replica: int | None = None

    @classmethod
    def from_json(cls, text: str | bytes) -> "Profile":
        """Parse and validate; raises ``ProfileError`` listing every problem."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError([("", f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")]) from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> "Profile":
        """Validate a decoded JSON document; raises ``ProfileError`` listing every problem."""
        problems: list[tuple[str, str]] = []
        if not isinstance(data, Mapping):
            raise ProfileError([("", "must be an object")])
        _unknown(data, {"version", "gpus_per_replica", "prefill", "decode", "model", "engine", "notes"}, "", problems)
        version = data.get("version", VERSION)
        if version != VERSION:
            problems.append(("version", f"must be {VERSION}, not {version!r}"))
        gpus = data.get("gpus_per_replica")
        if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0):
            problems.append(("gpus_per_replica", f"must be a whole number of GPUs, 0 or more, not {gpus!r}"))
        prefill = _curve(data, "prefill", "ttft_s", "isl", problems)
        decode = _curve(data, "decode", "itl_s", "context_tokens", problems)
        if problems or prefill is None or decode is None:
            raise ProfileError(problems)
        return cls(prefill=prefill, decode=decode, gpus_per_replica=gpus)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document ``from_dict`` reads back to an equal profile."""
        data: dict[str, Any] = {"version": VERSION}
        if self.gpus_per_replica is not None:
            data["gpus_per_replica"] = self.gpus_per_replica
        data["prefill"] = {
            "ttft_s": self.prefill.target_s,
            "points": [
                {"isl": _number(x), "tokens_per_s": _number(y)}
                for x, y in zip(self.prefill.lengths, self.prefill.tokens_per_s, strict=True)
            ],
        }
        data["decode"] = {
            "itl_s": self.decode.target_s,
            "points": [
                {"context_tokens": _number(x), "tokens_per_s": _number(y)}
                for x, y in zip(self.decode.lengths, self.decode.tokens_per_s, strict=True)
            ],
        }
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _number(value: float) -> float | int:
    return int(value) if value.is_integer() else value


def _unknown(data: Mapping[str, Any], known: set[str], path: str, problems: list[tuple[str, str]]) -> None:
    for key in data:
        if key not in known:
            problems.append((f"{path}{key}", f"unknown field (expected one of {', '.join(sorted(known))})"))


def _positive(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _curve(
    data: Mapping[str, Any], phase: str, target: str, length: str, problems: list[tuple[str, str]]
) -> CapacityCurve | None:
    section = data.get(phase)
    if section is None:
        problems.append((phase, "missing"))
        return None
    if not isinstance(section, Mapping):
        problems.append((phase, "must be an object"))
        return None
    before = len(problems)
    _unknown(section, {target, "points"}, f"{phase}.", problems)
    target_s = section.get(target)
    if target_s is None:
        problems.append((f"{phase}.{target}", "missing"))
    elif not _positive(target_s):
        problems.append((f"{phase}.{target}", f"must be a positive number of seconds, not {target_s!r}"))
    points = section.get("points")
    if points is None:
        problems.append((f"{phase}.points", "missing"))
        return None
    if not isinstance(points, Sequence) or isinstance(points, str):
        problems.append((f"{phase}.points", "must be a list"))
        return None
    if not points:
        problems.append((f"{phase}.points", "must have at least one point"))
    lengths: list[float] = []
    capacities: list[float] = []
    for i, point in enumerate(points):
        where = f"{phase}.points[{i}]"
        if not isinstance(point, Mapping):
            problems.append((where, "must be an object"))
            continue
        _unknown(point, {length, "tokens_per_s"}, f"{where}.", problems)
        for key in (length, "tokens_per_s"):
            value = point.get(key)
            if value is None:
                problems.append((f"{where}.{key}", "missing"))
            elif not _positive(value):
                problems.append((f"{where}.{key}", f"must be a positive number, not {value!r}"))
        x, y = point.get(length), point.get("tokens_per_s")
        if _positive(x) and _positive(y):
            if lengths and x <= lengths[-1]:
                problems.append(
                    (f"{where}.{length}", f"must be greater than the previous point's ({_number(lengths[-1])})")
                )
                continue
            lengths.append(float(x))
            capacities.append(float(y))
    if len(problems) > before or not _positive(target_s):
        return None
    return CapacityCurve(float(target_s), tuple(lengths), tuple(capacities))
