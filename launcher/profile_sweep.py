"""The pure parts of ``flotilla profile``: what a sweep's samples measure, and which point a profile keeps.

Every duration and rate here is in the engine's own time. A real engine's time is the wall clock's; the
mocker's runs ``speedup_ratio`` times faster than the wall clock (engines/mocker/timing.py divides every
step's simulated duration by it before sleeping), so a wall-clock duration is that many times longer in
the time the profile is about, and a wall-clock rate that many times lower (``TimeScale``).

A prefill point is a closed loop: ``concurrency`` clients each send prompt-only requests (one output
token) back to back. Its latency is the TTFT at the percentile, its capacity the prompt tokens computed
per second over the whole run. A decode point is one wave of ``concurrency`` requests sent together;
it is measured only while every one of them is decoding (after the last first token, before the first
finish), so that neither a prefill nor a smaller batch is mixed into it: its latency is the ITL at the
percentile, its capacity the output tokens per second in that window.
"""

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from planner.profile import Profile

Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class TimeScale:
    """How the engine's time relates to the wall clock: ``speedup`` engine seconds pass per wall second."""

    speedup: float = 1.0

    def seconds(self, wall_s: float) -> float:
        """A wall-clock duration in engine seconds."""
        return wall_s * self.speedup

    def rate(self, per_wall_s: float) -> float:
        """A rate per wall-clock second as a rate per engine second."""
        return per_wall_s / self.speedup


@dataclass(frozen=True)
class Point:
    """One measured point: ``concurrency`` requests at a time of ``length`` tokens (ISL, or context)."""

    phase: Phase
    length: int
    concurrency: int
    requests: int
    #: TTFT (prefill) or ITL (decode) at the percentile, in engine seconds.
    latency_s: float
    #: Prompt tokens (prefill) or output tokens (decode) per engine second.
    tokens_per_s: float

    def meets(self, target_s: float) -> bool:
        return self.latency_s <= target_s


@dataclass(frozen=True)
class Shortfall:
    """No point of ``phase`` at ``length`` met ``target_s``; ``closest`` is the one with the lowest latency."""

    phase: Phase
    length: int
    target_s: float
    closest: Point | None

    def __str__(self) -> str:
        what = "TTFT" if self.phase == "prefill" else "ITL"
        where = f"ISL {self.length}" if self.phase == "prefill" else f"context {self.length}"
        said = f"{self.phase} at {where}: no concurrency met the {what} target of {self.target_s:g} s"
        if self.closest is None:
            return f"{said} (nothing was measured)"
        point = self.closest
        return (
            f"{said}; the best measured was {what} {point.latency_s:.4g} s at concurrency {point.concurrency} "
            f"({point.tokens_per_s:,.0f} tokens/s)"
        )


def percentile(values: Iterable[float], percent: float) -> float:
    """The ``percent`` (0-100] percentile, interpolating linearly between samples; 0.0 for no samples."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = percent / 100 * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def concurrency_levels(maximum: int) -> list[int]:
    """1, 2, 4, ... doubling while below ``maximum``, then ``maximum`` itself."""
    levels = [1]
    while levels[-1] * 2 < maximum:
        levels.append(levels[-1] * 2)
    if maximum > 1:
        levels.append(maximum)
    return levels


def best_point(points: Iterable[Point], target_s: float) -> Point | None:
    """The point with the most tokens per second among those within ``target_s``; None when none is."""
    meeting = [point for point in points if point.meets(target_s)]
    return max(meeting, key=lambda point: point.tokens_per_s, default=None)


def shortfall(points: Sequence[Point], phase: Phase, length: int, target_s: float) -> Shortfall | None:
    """What to tell when no point meets ``target_s``; None when one does."""
    if best_point(points, target_s) is not None:
        return None
    closest = min(points, key=lambda point: (point.latency_s, -point.tokens_per_s), default=None)
    return Shortfall(phase, length, target_s, closest)


def prefill_point(
    isl: int,
    concurrency: int,
    ttfts_wall_s: Sequence[float],
    elapsed_wall_s: float,
    *,
    percent: float,
    scale: TimeScale,
) -> Point:
    """A prefill point from each request's wall-clock TTFT and the run's wall-clock duration."""
    tokens = isl * len(ttfts_wall_s)
    return Point(
        phase="prefill",
        length=isl,
        concurrency=concurrency,
        requests=len(ttfts_wall_s),
        latency_s=scale.seconds(percentile(ttfts_wall_s, percent)),
        tokens_per_s=scale.rate(tokens / elapsed_wall_s) if elapsed_wall_s > 0 else 0.0,
    )


#: One request's stream, as it arrived: (wall-clock time, tokens in that output), first output first.
Arrivals = Sequence[tuple[float, int]]


def decode_point(
    context: int,
    concurrency: int,
    streams: Sequence[Arrivals],
    *,
    percent: float,
    scale: TimeScale,
) -> Point:
    """A decode point from the arrivals of one wave of requests sent together.

    Only what arrived while every request was decoding counts: after the last first output, up to the
    first request's last output (and as ITL only the gaps that began in that window). An output of several
    tokens (a reader that fell a step behind gets two steps' tokens at once) counts as that many inter-token
    gaps of an equal share of its wait. When the requests never all decoded at once (their prompts took
    longer than their outputs), each one's whole decode counts instead, over the span from the first first
    output to the last output.
    """
    decoding = [stream for stream in streams if len(stream) > 1]
    start = max((stream[0][0] for stream in decoding), default=0.0)
    end = min((stream[-1][0] for stream in decoding), default=0.0)
    overlapping = bool(decoding) and len(decoding) == len(streams) and end > start
    gaps: list[float] = []
    tokens = 0
    for stream in decoding:
        for (before, _), (at, count) in itertools.pairwise(stream):
            if overlapping and not start < at <= end:
                continue
            tokens += count
            if overlapping and before < start:
                continue  # a gap that began before every request decoded holds a prompt's step too
            gaps.extend([(at - before) / count] * count)
    if overlapping:
        span = end - start
    else:
        span = max((s[-1][0] for s in decoding), default=0.0) - min((s[0][0] for s in decoding), default=0.0)
    return Point(
        phase="decode",
        length=context,
        concurrency=concurrency,
        requests=len(streams),
        latency_s=scale.seconds(percentile(gaps, percent)),
        tokens_per_s=scale.rate(tokens / span) if span > 0 else 0.0,
    )


def decode_shape(context: int, output_tokens: int) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a decode request whose mean context over its decode is ``context``.

    The planner looks decode capacity up at ISL + OSL/2 (docs/planner.md), the context a request has on
    average while it decodes: the prompt is ``context`` less half the output, and the output at most
    ``context`` (so that the prompt keeps at least half of it).
    """
    output = max(2, min(output_tokens, context))
    return max(1, context - output // 2), output


def profile_document(
    prefill: Sequence[Point],
    decode: Sequence[Point],
    *,
    ttft_target_s: float,
    itl_target_s: float,
    gpus_per_replica: int,
    model: str,
    engine: str,
    notes: str,
) -> dict[str, Any]:
    """The Profile JSON document of the chosen points (one per length, lengths ascending).

    Raises ProfileError when ``planner.profile.Profile`` would refuse it (it is checked by the reader
    the planner uses, so a file written here is one the planner takes).
    """
    document: dict[str, Any] = {
        "version": 1,
        "gpus_per_replica": gpus_per_replica,
        "model": model,
        "engine": engine,
        "notes": notes,
        "prefill": {
            "ttft_s": ttft_target_s,
            "points": [{"isl": p.length, "tokens_per_s": round(p.tokens_per_s, 1)} for p in _by_length(prefill)],
        },
        "decode": {
            "itl_s": itl_target_s,
            "points": [
                {"context_tokens": p.length, "tokens_per_s": round(p.tokens_per_s, 1)} for p in _by_length(decode)
            ],
        },
    }
    Profile.from_dict(document)
    return document


def _by_length(points: Sequence[Point]) -> list[Point]:
    return sorted(points, key=lambda point: point.length)
