"""From what the fleet reports to an ``Observation``: pure functions over snapshots, no scraping here.

The ingress exposes cumulative Prometheus histograms (frontend_gateway/metrics.py); the planner needs what
happened over one interval, so it takes two snapshots and works on their difference, as PromQL's
``histogram_quantile(q, rate(..._bucket[interval]))`` does. Workers report ``WorkerLoad`` once a second per
dp rank (runtime/kv/events.py); ``replica_loads`` folds the latest reports into one ``ReplicaLoad`` per
instance.
"""

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from planner.errors import PlannerError
from planner.observation import GroupObservation, Observation, ReplicaLoad
from runtime.kv.events import WorkerLoad

#: The ingress's metric names, after its default prefix (frontend_gateway/metrics.py).
TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
INPUT_TOKENS = "input_sequence_tokens"
OUTPUT_TOKENS = "output_sequence_tokens"


@dataclass(frozen=True)
class HistogramSnapshot:
    """A cumulative histogram at one moment: ``buckets`` are (upper bound, observations at or under it) in
    increasing order, the last bound ``inf``; ``total`` is the sum of the observed values."""

    buckets: tuple[tuple[float, float], ...]
    total: float = 0.0

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def __add__(self, other: "HistogramSnapshot") -> "HistogramSnapshot":
        """Two ingresses' histograms of the same metric, as one (their buckets must match)."""
        if not self.buckets:
            return other
        if not other.buckets:
            return self
        _same_bounds(self, other)
        buckets = tuple((le, a + b) for (le, a), (_, b) in zip(self.buckets, other.buckets, strict=True))
        return HistogramSnapshot(buckets, self.total + other.total)


EMPTY = HistogramSnapshot(())


def _same_bounds(a: HistogramSnapshot, b: HistogramSnapshot) -> None:
    if [le for le, _ in a.buckets] != [le for le, _ in b.buckets]:
        raise PlannerError("histogram snapshots have different buckets")


def histogram_delta(before: HistogramSnapshot, after: HistogramSnapshot) -> HistogramSnapshot:
    """What was observed between two snapshots. A counter that went down means the process restarted and
    counted from zero: then everything in ``after`` happened in the interval (as Prometheus' ``increase``)."""
    if not before.buckets:
        return after
    if not after.buckets:
        return EMPTY
    _same_bounds(before, after)
    deltas = [(le, b - a) for (le, a), (_, b) in zip(before.buckets, after.buckets, strict=True)]
    if any(d < 0 for _, d in deltas) or after.total < before.total:
        return after
    return HistogramSnapshot(tuple(deltas), after.total - before.total)


def histogram_quantile(q: float, histogram: HistogramSnapshot) -> float | None:
    """The ``q`` quantile (0..1) of a histogram's observations, interpolated linearly inside the bucket it
    falls in, as Prometheus' ``histogram_quantile``; None when it holds no observation. A quantile in the
    ``+Inf`` bucket is reported as the highest finite bound (all that can be said: "at least this")."""
    if not 0 <= q <= 1:
        raise PlannerError(f"quantile must be in [0, 1], not {q}")
    total = histogram.count
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, cumulative in histogram.buckets:
        if cumulative >= rank and cumulative > below:
            if math.isinf(upper):
                return lower
            if upper <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


def histogram_mean(histogram: HistogramSnapshot) -> float | None:
    """The mean observed value (None: no observation)."""
    return histogram.total / histogram.count if histogram.count > 0 else None


def counter_increase(before: float, after: float) -> float:
    """How much a counter grew; one that went down restarted from zero, so all of ``after`` is new."""
    return after - before if after >= before else after


def counter_rate(before: float, after: float, seconds: float) -> float:
    """A counter's growth per second over ``seconds``."""
    if seconds <= 0:
        raise PlannerError(f"an interval must be positive, not {seconds} s")
    return counter_increase(before, after) / seconds


#: A series' labels, ``le`` aside, sorted: which ingress (and model) a histogram's series is.
SeriesKey = tuple[tuple[str, str], ...]


def histograms_by_series(text: str, name: str, labels: Mapping[str, str]) -> dict[SeriesKey, HistogramSnapshot]:
    """Each series of the histogram ``name`` (its full name, without ``_bucket``) whose labels include ``labels``,
    from a Prometheus text exposition, by its other labels (one per ingress where a Prometheus adds ``instance``).

    The text crossed a process boundary (an ingress's or a Prometheus's answer): what is not a histogram the
    planner can read (not text exposition, a bucket without a bound, a count that is not a finite number at or
    over 0) raises PlannerError rather than being believed."""
    found: dict[SeriesKey, HistogramSnapshot] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name != name or family.type != "histogram":
                continue
            series: dict[SeriesKey, tuple[dict[float, float], list[float]]] = {}
            for sample in family.samples:
                if any(sample.labels.get(k) != v for k, v in labels.items()):
                    continue
                key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                bounds, total = series.setdefault(key, ({}, [0.0]))
                if sample.name == f"{name}_bucket":
                    bound = sample.labels.get("le")
                    if bound is None or math.isnan(float(bound)):
                        raise PlannerError(f"{sample.name} has a bucket without a bound (le={bound!r})")
                    bounds[float(bound)] = _count(sample.name, sample.value)
                elif sample.name == f"{name}_sum":
                    if not math.isfinite(float(sample.value)):
                        raise PlannerError(f"{sample.name} is {sample.value!r}, not a finite number")
                    total[0] = float(sample.value)
            for key, (bounds, total) in series.items():
                found[key] = found.get(key, EMPTY) + HistogramSnapshot(tuple(sorted(bounds.items())), total[0])
    except ValueError as exc:  # the parser's word for text that is not exposition
        raise PlannerError(f"not Prometheus text exposition: {str(exc)[:200]}") from exc
    return found


def _count(name: str, value: float) -> float:
    count = float(value)
    if not (math.isfinite(count) and count >= 0):
        raise PlannerError(f"{name} counts {value!r}, not a finite number at or over 0")
    return count


def check_ingress_exposition(text: str, prefix: str = "flotilla_frontend") -> None:
    """Raise PlannerError unless the four ingress histograms in ``text`` (every model's) are ones the planner
    can read: checked once when the text arrives, so that a gateway answering nonsense is one that cannot be
    read, as one that does not answer."""
    for name in (TTFT, ITL, INPUT_TOKENS, OUTPUT_TOKENS):
        histograms_by_series(text, f"{prefix}_{name}", {})


def exposition_by_source(texts: Mapping[str, str], label: str = "instance") -> str:
    """Several ingresses' ``/metrics`` texts (by where each was read) as one text exposition whose series carry
    ``label`` = where: each ingress is then a source of its own for ``ingress_snapshot``, as each target of a
    Prometheus is by its ``instance``. Only histograms are kept. Raises PlannerError for a text that is not
    exposition."""
    result: list[dict[str, Any]] = []
    for where, text in texts.items():
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as exc:
            raise PlannerError(f"{where}: not Prometheus text exposition: {str(exc)[:200]}") from exc
        for family in families:
            if family.type != "histogram":
                continue
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_sum", "_count")):
                    metric = {**sample.labels, label: where, "__name__": sample.name}
                    result.append({"metric": metric, "value": [0, repr(float(sample.value))]})
    return exposition_from_query(result)


def histogram_from_exposition(text: str, name: str, labels: Mapping[str, str]) -> HistogramSnapshot:
    """The histogram ``name`` whose labels include ``labels``, from a Prometheus text exposition; series that
    match are added (EMPTY when none does)."""
    found = EMPTY
    for snapshot in histograms_by_series(text, name, labels).values():
        found = found + snapshot
    return found


def ingress_histograms_selector(prefix: str = "flotilla_frontend") -> str:
    """A PromQL selector of every series of the four ingress histograms the planner reads (every model, every
    ingress a Prometheus scrapes)."""
    names = "|".join((TTFT, ITL, INPUT_TOKENS, OUTPUT_TOKENS))
    return f'{{__name__=~"{prefix}_({names})_(bucket|sum|count)"}}'


def exposition_from_query(result: Any) -> str:
    """A Prometheus instant query's vector (its ``data.result``: ``[{"metric": {...}, "value": [t, "v"]}]``) as
    text exposition, so that ``ingress_snapshot`` reads what Prometheus holds as it reads one ingress's
    ``/metrics``. Each ingress Prometheus scrapes keeps its own series (its ``instance`` label), which
    ``histogram_from_exposition`` adds up. Raises PlannerError for a result of another shape."""
    if not isinstance(result, list):
        raise PlannerError("the query's result is not a vector")
    families: dict[str, list[str]] = {}
    for sample in result:
        try:
            labels = dict(sample["metric"])
            name = labels.pop("__name__")
            value = float(sample["value"][1])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PlannerError(f"a sample of the query's result is malformed: {str(sample)[:200]}") from exc
        family = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        shown = ",".join(f'{key}="{_escaped(str(text))}"' for key, text in sorted(labels.items()))
        families.setdefault(family, []).append(f"{name}{{{shown}}} {value!r}")
    lines = []
    for family, samples in sorted(families.items()):
        lines.append(f"# TYPE {family} histogram")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


def _escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(frozen=True)
class IngressSnapshot:
    """The ingress histograms of one model at one moment (``at_s``: the caller's clock, in seconds).

    ``sources`` holds each ingress's own four histograms (by its series' labels: ``instance`` and ``job`` where a
    Prometheus scrapes several), of which the fields are the sum. ``ingress_stats`` measures an interval
    ingress by ingress, so that one ingress restarted (its counters back at zero) counts what it saw since, not
    what every ingress saw since it started. Empty: one source, the fields."""

    at_s: float
    ttft: HistogramSnapshot = EMPTY
    itl: HistogramSnapshot = EMPTY
    input_tokens: HistogramSnapshot = EMPTY
    output_tokens: HistogramSnapshot = EMPTY
    sources: Mapping[SeriesKey, "IngressSnapshot"] = field(default_factory=dict)

    def __add__(self, other: "IngressSnapshot") -> "IngressSnapshot":
        """Two ingresses' snapshots of the same model taken together (the later moment is kept)."""
        return IngressSnapshot(
            max(self.at_s, other.at_s),
            self.ttft + other.ttft,
            self.itl + other.itl,
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
        )


def ingress_snapshot(text: str, model: str, at_s: float, prefix: str = "flotilla_frontend") -> IngressSnapshot:
    """``model``'s histograms in an ingress's ``/metrics`` text, or in several ingresses' as a Prometheus holds
    them (each its own source)."""
    labels = {"model": model}
    names = {
        "ttft": f"{prefix}_{TTFT}",
        "itl": f"{prefix}_{ITL}",
        "input_tokens": f"{prefix}_{INPUT_TOKENS}",
        "output_tokens": f"{prefix}_{OUTPUT_TOKENS}",
    }
    sources: dict[SeriesKey, IngressSnapshot] = {}
    for attribute, name in names.items():
        for key, snapshot in histograms_by_series(text, name, labels).items():
            where = tuple((k, v) for k, v in key if k != "model")
            source = sources.get(where, IngressSnapshot(at_s))
            grown = getattr(source, attribute) + snapshot
            sources[where] = dataclasses.replace(source, **{attribute: grown})
    whole = IngressSnapshot(at_s)
    for part in sources.values():
        whole = whole + part
    return dataclasses.replace(whole, sources=sources)


def _interval(before: IngressSnapshot, after: IngressSnapshot) -> IngressSnapshot:
    """What the ingresses observed between two snapshots, source by source where both name their sources (a
    source first seen in ``after`` gives its baseline: nothing of it is counted yet)."""
    if not (before.sources and after.sources):
        return IngressSnapshot(
            after.at_s,
            histogram_delta(before.ttft, after.ttft),
            histogram_delta(before.itl, after.itl),
            histogram_delta(before.input_tokens, after.input_tokens),
            histogram_delta(before.output_tokens, after.output_tokens),
        )
    seen = IngressSnapshot(after.at_s)
    for key, now in after.sources.items():
        if (then := before.sources.get(key)) is not None:
            seen = seen + _interval(then, now)
    return seen


@dataclass(frozen=True)
class IngressStats:
    """The traffic of one interval: requests per second finished, mean prompt and completion lengths, and
    TTFT and ITL at ``percentile`` (None where nothing was observed)."""

    interval_s: float
    request_rate: float
    mean_isl: float | None
    mean_osl: float | None
    percentile: float
    ttft_s: float | None
    itl_s: float | None


def ingress_stats(before: IngressSnapshot, after: IngressSnapshot, percentile: float = 90.0) -> IngressStats:
    """What happened between two snapshots. Every finished request observes its prompt length once, so the
    input-length histogram's count is the request count."""
    seconds = after.at_s - before.at_s
    if seconds <= 0:
        raise PlannerError(f"the second snapshot must be later than the first ({before.at_s} → {after.at_s})")
    q = percentile / 100
    seen = _interval(before, after)
    return IngressStats(
        interval_s=seconds,
        request_rate=seen.input_tokens.count / seconds,
        mean_isl=histogram_mean(seen.input_tokens),
        mean_osl=histogram_mean(seen.output_tokens),
        percentile=percentile,
        ttft_s=histogram_quantile(q, seen.ttft),
        itl_s=histogram_quantile(q, seen.itl),
    )


def replica_loads(
    reports: Iterable[WorkerLoad],
    *,
    queued_prefill_tokens: Mapping[int, float] | None = None,
    mean_isl: float | None = None,
) -> tuple[ReplicaLoad, ...]:
    """One ``ReplicaLoad`` per instance, from the latest report of each of its dp ranks (a later report of
    the same rank replaces an earlier one), ordered by instance id.

    KV usage is the instance's blocks in use over its blocks, where every rank says both; otherwise the mean
    of the ranks' ``kv_usage``. Queued prompt tokens come from ``queued_prefill_tokens`` (by instance: what a
    router knows it sent and was not yet computed); without them they are estimated as waiting requests
    times ``mean_isl``; without either, unknown, except that an instance whose every rank says nothing
    waits has none queued whatever the prompts' length (no request finished in an idle interval, so its
    mean ISL is unknown exactly when a scale-down needs the queue to be known).
    """
    latest: dict[tuple[int, int], WorkerLoad] = {}
    for report in reports:
        latest[(report.instance_id, report.dp_rank)] = report
    ranks: dict[int, list[WorkerLoad]] = {}
    for (instance_id, _), report in sorted(latest.items()):
        ranks.setdefault(instance_id, []).append(report)
    loads = []
    for instance_id, rank_reports in ranks.items():
        queued: float | None = None
        if queued_prefill_tokens is not None and instance_id in queued_prefill_tokens:
            queued = float(queued_prefill_tokens[instance_id])
        elif all(r.waiting is not None for r in rank_reports):
            waiting = sum(r.waiting or 0 for r in rank_reports)
            if waiting == 0:
                queued = 0.0
            elif mean_isl is not None:
                queued = waiting * mean_isl
        loads.append(
            ReplicaLoad(
                instance_id=instance_id,
                active_requests=sum(r.active_requests for r in rank_reports),
                queued_prefill_tokens=queued,
                kv_usage=_kv_usage(rank_reports),
            )
        )
    return tuple(loads)


def _kv_usage(reports: Sequence[WorkerLoad]) -> float | None:
    if all(r.kv_active_blocks is not None and r.kv_total_blocks for r in reports):
        total = sum(r.kv_total_blocks or 0 for r in reports)
        return sum(r.kv_active_blocks or 0 for r in reports) / total
    usages = [r.kv_usage for r in reports if r.kv_usage is not None]
    return sum(usages) / len(usages) if usages else None


def prefix_hit_rate(reports: Iterable[WorkerLoad]) -> float | None:
    """The mean prefix hit rate the ranks report (None: none reports one)."""
    rates = [r.prefix_hit_rate for r in reports if r.prefix_hit_rate is not None]
    return sum(rates) / len(rates) if rates else None


def observation(
    stats: IngressStats, groups: Sequence[GroupObservation], *, prefix_hit_rate: float | None = None
) -> Observation:
    """The planner's input for one interval."""
    return Observation(
        interval_s=stats.interval_s,
        request_rate=stats.request_rate,
        mean_isl=stats.mean_isl,
        mean_osl=stats.mean_osl,
        percentile=stats.percentile,
        ttft_s=stats.ttft_s,
        itl_s=stats.itl_s,
        prefix_hit_rate=prefix_hit_rate,
        groups=tuple(groups),
    )
