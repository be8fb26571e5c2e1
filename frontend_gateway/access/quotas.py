"""Per-key limits (requests and tokens per minute, tokens per month) and usage, counted on the ingress and
shared by every ingress process through Redis.

Why counted here and flushed, rather than asked of Redis per request: a request only touches dicts in this
process (no I/O on its path, which keeps keys and limits within the ingress's CPU budget); every
``FLUSH_S`` (0.1 s) one Redis pipeline adds this process's counts to the fleet's and reads the fleet's
totals back. A request is refused when the fleet's total, as last read, plus what this process counted
since reaches the limit. So the limit is the fleet's, whatever process a client's connections land on
(per-process shares of a limit would give a client pinned to one process a fraction of it), and the
overshoot is bounded by what the other processes admit within one flush (rate x 0.1 s x processes).

Minutes slide: the count is this fixed minute's plus the previous minute's weighted by the part of it
still inside the last 60 s (the approximation Cloudflare describes for its rate limiter). Months are
calendar months (UTC). A limit of tokens refuses once the minute's (or month's) tokens reached it: a
request's tokens are known only as it ends, so the request that crosses the limit is served.

Usage: per key, model and UTC day — requests, prompt tokens, cached prompt tokens, completion tokens and
errors — is added into one Redis hash per day, which the control plane drains into its database
(``controlplane/apikeys/usage.py``). Nothing is written to a database on a request's path.

What a failure loses: with Redis down, each process enforces its limits on what it has seen (the last
fleet totals it read plus its own counts) and keeps its counts, which go to Redis once it answers; a clean
stop flushes them; a crash of this process loses at most the last ``FLUSH_S`` of counts.
"""

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

from frontend_gateway.errors import GatewayError
from runtime.fleet_contract.api_keys import KeyRecord
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

FLUSH_S = 0.1
USAGE_PREFIX = "flotilla:usage:"  # + YYYY-MM-DD: a hash of "<key id>\t<model>\t<field>" -> count
USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")
_RATE_PREFIX = "flotilla:rate:"
_BUDGET_PREFIX = "flotilla:budget:"
_WINDOW_S = 60
_WINDOW_TTL_S = 3 * _WINDOW_S
_MONTH_TTL_S = 40 * 86400
#: A key's fleet totals are kept fresh this long after this process last saw it.
_KEEP_FRESH_S = 2 * _WINDOW_S
#: Model names kept apart in usage; others (names no model has) are counted under this one.
UNKNOWN_MODEL = "(unknown model)"


class RateLimited(GatewayError):
    """The key's requests or tokens per minute are used up (429 with Retry-After, as OpenAI answers)."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    error_type = "requests"
    code = "rate_limit_exceeded"


class QuotaExhausted(GatewayError):
    """The key's monthly token budget is used up (429 ``insufficient_quota``, as OpenAI answers)."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    error_type = "insufficient_quota"
    code = "insufficient_quota"


@dataclass
class _Window:
    """A key's counts in one fixed minute: the fleet's as last read, and this process's since."""

    window: int
    fleet_requests: int = 0
    fleet_tokens: int = 0
    previous_requests: int = 0  # the fleet's in the minute before
    previous_tokens: int = 0
    requests: int = 0  # counted here, not flushed yet
    tokens: int = 0


@dataclass
class _Month:
    month: str
    fleet_tokens: int = 0
    tokens: int = 0  # counted here, not flushed yet


@dataclass
class _KeyState:
    minute: _Window
    month: _Month
    seen: float = 0.0


@dataclass
class _Usage:
    counts: list[int] = field(default_factory=lambda: [0] * len(USAGE_FIELDS))


class Meter:
    """Counts each key's requests and tokens, refuses what is over its limits, and flushes to ``redis``
    (a ``redis.asyncio`` client; None: this process counts alone, and usage is not recorded)."""

    def __init__(self, redis: Any | None, *, clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._clock = clock
        self._keys: dict[int, _KeyState] = {}
        self._usage: dict[tuple[str, int, str], _Usage] = {}
        #: Minutes that ended with counts not flushed yet: they go to their own minute at the next flush.
        self._late: list[tuple[int, _Window]] = []
        self._failing = RateLimitedLog(log, period_s=60.0)

    # -- the request's path: no I/O ----------------------------------------------------------------------

    def charge(self, key: KeyRecord) -> None:
        """Count one request of ``key``, or raise RateLimited / QuotaExhausted (with Retry-After and the
        ``x-ratelimit-*`` headers) when it is over a limit."""
        rpm, tpm, budget = key.requests_per_minute, key.tokens_per_minute, key.monthly_token_budget
        if rpm is None and tpm is None and budget is None:
            return
        now = self._clock()
        state = self._state(key.key_id, now)
        _, fraction = _minute_of(now)
        window, month = state.minute, state.month
        requests_now = window.fleet_requests + window.requests
        tokens_now = window.fleet_tokens + window.tokens
        requests = requests_now + window.previous_requests * (1.0 - fraction)
        tokens = tokens_now + window.previous_tokens * (1.0 - fraction)
        if rpm is not None and requests + 1 > rpm:
            wait = _wait_s(rpm - 1, requests_now, window.previous_requests, fraction)
            message = f"Rate limit reached for API key {key.name!r}: {rpm} requests per minute."
            raise _limited(RateLimited(message), wait, _headers(key, requests, tokens, fraction))
        if tpm is not None and tokens >= tpm:
            wait = _wait_s(tpm - 1, tokens_now, window.previous_tokens, fraction)
            message = f"Rate limit reached for API key {key.name!r}: {tpm} tokens per minute."
            raise _limited(RateLimited(message), wait, _headers(key, requests, tokens, fraction))
        if budget is not None and month.fleet_tokens + month.tokens >= budget:
            message = (
                f"API key {key.name!r} used its monthly budget of {budget} tokens; it renews on the 1st (UTC), "
                "or an operator raises it."
            )
            headers = _headers(key, requests, tokens, fraction)
            raise _limited(QuotaExhausted(message), _seconds_to_next_month(now), headers)
        window.requests += 1

    def finished(
        self,
        key: KeyRecord,
        model: str,
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        error: bool = False,
    ) -> None:
        """Count a finished (or refused, ``error``) request of ``key`` on ``model``: its tokens and its usage."""
        now = self._clock()
        tokens = prompt_tokens + completion_tokens
        if tokens and (key.tokens_per_minute is not None or key.monthly_token_budget is not None):
            state = self._state(key.key_id, now)
            state.minute.tokens += tokens
            state.month.tokens += tokens
        if self._redis is None:
            return
        counts = self._usage.setdefault((_day_of(now), key.key_id, model), _Usage()).counts
        for index, value in enumerate((1, prompt_tokens, cached_tokens, completion_tokens, int(error))):
            counts[index] += value

    def _state(self, key_id: int, now: float) -> _KeyState:
        minute, _ = _minute_of(now)
        month = _month_of(now)
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState(_Window(minute), _Month(month))
        if state.minute.window != minute:
            # A new minute: what was counted here still goes to the minute it was counted in, at the flush.
            old = state.minute
            carried = old.window == minute - 1
            state.minute = _Window(
                minute,
                previous_requests=old.fleet_requests + old.requests if carried else 0,
                previous_tokens=old.fleet_tokens + old.tokens if carried else 0,
            )
            if old.requests or old.tokens:
                self._late.append((key_id, old))
        if state.month.month != month:
            state.month = _Month(month)
        state.seen = now
        return state

    # -- the flush: one Redis pipeline every FLUSH_S ----------------------------------------------------------

    async def run(self) -> None:
        """Flush every ``FLUSH_S`` until cancelled."""
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def close(self) -> None:
        """Flush what is left (a clean stop loses nothing that Redis takes), and close the Redis client."""
        if not await self.flush():
            log.warning("stopping with counts Redis did not take: this process's last usage is lost")
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    async def flush(self) -> bool:
        """Send this process's counts and read the fleet's; False (logged) when Redis did not answer, and
        the counts are kept for the next flush."""
        if self._redis is None:
            return True
        now = self._clock()
        pipe = self._redis.pipeline(transaction=False)
        late, self._late = self._late, []
        sent: list[tuple[_Window, int, int]] = [(window, window.requests, window.tokens) for _, window in late]
        for key_id, window in late:
            _add_window(pipe, key_id, window.window, window.requests, window.tokens)
        # The objects as they are now: a minute that ends during the round trip gets new ones meanwhile.
        fresh = [(key_id, state.minute, state.month) for key_id, state in self._keys.items()]
        months: list[tuple[_Month, int]] = []
        for key_id, window, month in fresh:
            _add_window(pipe, key_id, window.window, window.requests, window.tokens)
            pipe.mget(_rate_key(key_id, window.window - 1, "r"), _rate_key(key_id, window.window - 1, "t"))
            budget = f"{_BUDGET_PREFIX}{key_id}:{month.month}"
            pipe.incrby(budget, month.tokens)
            pipe.expire(budget, _MONTH_TTL_S)
            sent.append((window, window.requests, window.tokens))
            months.append((month, month.tokens))
        usage, self._usage = self._usage, {}
        for (day, key_id, model), counts in usage.items():
            name = f"{USAGE_PREFIX}{day}"
            for field_name, value in zip(USAGE_FIELDS, counts.counts, strict=True):
                if value:
                    pipe.hincrby(name, f"{key_id}\t{model}\t{field_name}", value)
        try:
            results = await pipe.execute()
        except Exception as exc:  # redis.exceptions.RedisError and OSError alike: nothing may stop the loop
            self._late = late + self._late
            for key, counts in usage.items():
                mine = self._usage.setdefault(key, _Usage()).counts
                for index, value in enumerate(counts.counts):
                    mine[index] += value
            self._failing.warning(f"API key limits and usage: Redis did not take this process's counts ({exc}); kept")
            return False
        # What was sent is the fleet's now; what was counted during the round trip stays this process's.
        for window, requests, tokens in sent:
            window.requests -= requests
            window.tokens -= tokens
        for month, tokens in months:
            month.tokens -= tokens
        position = len(late) * 4
        for _, window, month in fresh:
            window.fleet_requests, window.fleet_tokens = int(results[position]), int(results[position + 2])
            window.previous_requests, window.previous_tokens = (int(value or 0) for value in results[position + 4])
            month.fleet_tokens = int(results[position + 5])
            position += 7
        for key_id in [key_id for key_id, state in self._keys.items() if now - state.seen > _KEEP_FRESH_S]:
            del self._keys[key_id]
        return True


def _add_window(pipe: Any, key_id: int, window: int, requests: int, tokens: int) -> None:
    """Four commands: the window's requests and tokens, added (read back), and their expiries."""
    for kind, value in (("r", requests), ("t", tokens)):
        name = _rate_key(key_id, window, kind)
        pipe.incrby(name, value)
        pipe.expire(name, _WINDOW_TTL_S)


def _rate_key(key_id: int, window: int, kind: str) -> str:
    return f"{_RATE_PREFIX}{key_id}:{window}:{kind}"


def _minute_of(now: float) -> tuple[int, float]:
    """The fixed minute ``now`` is in, and how far into it (0..1)."""
    minute, into = divmod(now, _WINDOW_S)
    return int(minute), into / _WINDOW_S


@functools.lru_cache(maxsize=4)
def _dates_of_day(day: int) -> tuple[str, str]:
    """The UTC day number ``day`` as "YYYY-MM-DD" and its month as "YYYY-MM" (cached: asked per request)."""
    moment = datetime.fromtimestamp(day * 86400, UTC)
    return moment.strftime("%Y-%m-%d"), moment.strftime("%Y-%m")


def _day_of(now: float) -> str:
    return _dates_of_day(int(now // 86400))[0]


def _month_of(now: float) -> str:
    return _dates_of_day(int(now // 86400))[1]


def _seconds_to_next_month(now: float) -> float:
    moment = datetime.fromtimestamp(now, UTC)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return datetime(year, month, 1, tzinfo=UTC).timestamp() - now


def _wait_s(allowed: float, current: float, previous: float, fraction: float) -> float:
    """Seconds until this minute's ``current`` plus the still-counted part of the previous minute's
    ``previous`` is at most ``allowed`` (new counts left aside)."""
    if current <= allowed:
        if previous <= 0:
            return 0.0
        needed = 1.0 - (allowed - current) / previous  # the part of this minute at which it fits
        return max(0.0, needed - fraction) * _WINDOW_S
    # Only the next minute helps, once this one's count, then the previous, has faded enough.
    fades = 1.0 - max(0.0, allowed) / current
    return ((1.0 - fraction) + fades) * _WINDOW_S


def _headers(key: KeyRecord, requests: float, tokens: float, fraction: float) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers for ``key`` at these counts."""
    reset = f"{math.ceil((1.0 - fraction) * _WINDOW_S)}s".encode()
    headers = []
    if key.requests_per_minute is not None:
        left = max(0, key.requests_per_minute - math.ceil(requests))
        headers += [
            (b"x-ratelimit-limit-requests", str(key.requests_per_minute).encode()),
            (b"x-ratelimit-remaining-requests", str(left).encode()),
            (b"x-ratelimit-reset-requests", reset),
        ]
    if key.tokens_per_minute is not None:
        left = max(0, key.tokens_per_minute - math.ceil(tokens))
        headers += [
            (b"x-ratelimit-limit-tokens", str(key.tokens_per_minute).encode()),
            (b"x-ratelimit-remaining-tokens", str(left).encode()),
            (b"x-ratelimit-reset-tokens", reset),
        ]
    return headers


def _limited(error: GatewayError, wait_s: float, headers: list[tuple[bytes, bytes]]) -> GatewayError:
    error.retry_after = max(1, math.ceil(wait_s))
    error.headers = headers
    return error
