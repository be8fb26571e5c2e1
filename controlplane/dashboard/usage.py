"""The Usage page's queries: the rows ``/api/v1/usage/`` would give for the same person and filters, their
totals, and the series its charts draw (per key and per model, one point a UTC day).

An operator sees the usage of their own keys, an admin everyone's, as in the API.
"""

import datetime
from typing import Any

from django.db.models import F, Max, Min, QuerySet, Sum

from controlplane.accounts.models import User
from controlplane.apikeys.models import ApiKey, KeyUsage

# Series beyond this many (the largest first) are added up as one "others" line, so a chart stays legible.
MAX_SERIES = 8
# A chart over a longer span than this shows its last days only.
MAX_DAYS = 731
MEASURES = ("tokens", "requests")


def visible_keys(person: User) -> QuerySet[ApiKey]:
    """The keys whose usage ``person`` may see: their own, or everyone's for an admin."""
    return ApiKey.visible_to(person).order_by("name", "id")


def usage_rows(
    person: User,
    *,
    key: int | None = None,
    model: str = "",
    since: datetime.date | None = None,
    until: datetime.date | None = None,
) -> QuerySet[KeyUsage]:
    """``person``'s visible usage rows that match the filters (as the API's ``UsageFilter``), newest first."""
    rows = KeyUsage.objects.select_related("key__owner").filter(key__in=visible_keys(person))
    if key is not None:
        rows = rows.filter(key_id=key)
    if model:
        rows = rows.filter(model=model)
    if since is not None:
        rows = rows.filter(day__gte=since)
    if until is not None:
        rows = rows.filter(day__lte=until)
    return rows.order_by("-day", "key__name", "key_id", "model")


def totals(rows: QuerySet[KeyUsage]) -> dict[str, int]:
    """The sums of every count over ``rows`` (zeros when there are none)."""
    sums = rows.order_by().aggregate(
        requests=Sum("requests"),
        prompt_tokens=Sum("prompt_tokens"),
        cached_tokens=Sum("cached_tokens"),
        completion_tokens=Sum("completion_tokens"),
        errors=Sum("errors"),
    )
    return {name: value or 0 for name, value in sums.items()}


def day_range(
    rows: QuerySet[KeyUsage], since: datetime.date | None, until: datetime.date | None, today: datetime.date
) -> list[datetime.date]:
    """Every day from ``since`` (or the first row's) to ``until`` (or today, or the last row's if later),
    the last ``MAX_DAYS`` of them at most."""
    span = rows.order_by().aggregate(low=Min("day"), high=Max("day"))
    first = since or span["low"] or today
    last = until or max(today, span["high"] or today)
    if last < first:
        return []
    count = min((last - first).days + 1, MAX_DAYS)
    return [last - datetime.timedelta(days=back) for back in range(count - 1, -1, -1)]


def charts(rows: QuerySet[KeyUsage], days: list[datetime.date], key_labels: dict[int, str]) -> dict[str, Any]:
    """The charts' data: ``days`` as epoch seconds, and per key and per model a series each with its tokens
    (prompt + completion) and requests per day; the largest ``MAX_SERIES`` by tokens, the rest as "others"."""
    if not days:
        return {"days": [], "by_key": [], "by_model": []}
    index = {day: position for position, day in enumerate(days)}
    per_day = (
        rows.filter(day__gte=days[0], day__lte=days[-1])
        .order_by()
        .values("day", "key_id", "model")
        .annotate(requests_sum=Sum("requests"), tokens_sum=Sum(F("prompt_tokens") + F("completion_tokens")))
    )
    by_key: dict[str, dict[str, list[int]]] = {}
    by_model: dict[str, dict[str, list[int]]] = {}
    for row in per_day:
        position = index[row["day"]]
        key_label = key_labels.get(row["key_id"], f"key {row['key_id']}")
        for lines, label in ((by_key, key_label), (by_model, row["model"])):
            line = lines.setdefault(label, {measure: [0] * len(days) for measure in MEASURES})
            line["tokens"][position] += row["tokens_sum"] or 0
            line["requests"][position] += row["requests_sum"] or 0
    epoch = [int(datetime.datetime.combine(day, datetime.time(), datetime.UTC).timestamp()) for day in days]
    return {"days": epoch, "by_key": _largest(by_key, len(days)), "by_model": _largest(by_model, len(days))}


def _largest(lines: dict[str, dict[str, list[int]]], length: int) -> list[dict[str, Any]]:
    ranked = sorted(lines.items(), key=lambda item: (-sum(item[1]["tokens"]), -sum(item[1]["requests"]), item[0]))
    shown = [{"label": label, **values} for label, values in ranked[:MAX_SERIES]]
    rest = ranked[MAX_SERIES:]
    if rest:
        others: dict[str, Any] = {"label": f"{len(rest)} others"}
        for measure in MEASURES:
            others[measure] = [sum(values[measure][day] for _, values in rest) for day in range(length)]
        shown.append(others)
    return shown
