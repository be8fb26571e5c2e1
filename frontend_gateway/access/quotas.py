"""Per-key limits (requests and tokens per minute, tokens per month) and usage, counted on the ingress and
shared by every ingress process through Redis.

Why counted here and flushed, rather than asked of Redis per request: a request only touches dicts in this
process (no I/O on its path, which keeps keys and limits within the ingress's CPU budget); every
``FLUSH_S`` (0.1 s) one Redis script adds this process's counts to the fleet's and reads the fleet's
totals back (``quota_flush.py``: each batch applied once, even when a reply is lost and it is sent again).
A request is refused when the fleet's total, as last read, plus what this process counted since reaches the
limit. So the limit is the fleet's, whatever process a client's connections land on (per-process shares of
a limit would give a client pinned to one process a fraction of it).

Tokens are reserved: a request's tokens are known only as it ends, so at admission it sets aside the most
it may use (its prompt's tokens, known once it is tokenized, plus its ``max_tokens``, which defaults to
the room left in the context) against the minute's and the month's limits, and is refused (429) when they
would not fit; as it ends (finished, failed or cancelled) the reservation is replaced by the tokens it
used. A reservation is a count like any other: it reaches the other processes at the next flush. Hence
the overshoot: processes that admit requests of a key within the same flush do not see each other's, so
the fleet admits at most the limit on each process (processes x limit), and only when requests land on
several processes within 0.1 s of each other; one process alone never exceeds a limit.

The fleet's totals for a key are read before its first request (on first sight, or after the key was
idle ``_KEEP_FRESH_S`` and forgotten): the request waits for them, at most ``LOAD_TIMEOUT_S``.

Minutes slide: the count is this fixed minute's plus the previous minute's weighted by the part of it
still inside the last 60 s (the approximation Cloudflare describes for its rate limiter). A request's
tokens count in the minute it was admitted in. Months are calendar months (UTC).

Usage: per key, model and UTC day — requests, prompt tokens, cached prompt tokens, completion tokens and
errors — is added into one Redis hash per day, which the control plane drains into its database
(``controlplane/apikeys/usage.py``). Nothing is written to a database on a request's path.

What a failure loses: with Redis down, each process enforces its limits on what it has seen (the last
fleet totals it read plus its own counts; a key it meets then, after waiting ``LOAD_TIMEOUT_S``, on its
own counts alone) and keeps its counts, which go to Redis once it answers; a clean stop flushes them; a
crash of this process loses at most the last ``FLUSH_S`` of counts.
"""

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

from frontend_gateway.access.quota_flush import FLUSH_PREFIX, SCRIPT, Operations, script_args
from frontend_gateway.errors import GatewayError
from runtime.fleet_contract.api_keys import KeyRecord
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

FLUSH_S = 0.1
#: How long a request waits for its key's fleet totals, read before the first request of a key this process
#: does not know (first sight, or after it was idle): past it, the key is counted on this process's counts.
LOAD_TIMEOUT_S = 0.5
USAGE_PREFIX = "flotilla:usage:"  # + YYYY-MM-DD: a hash of "<key id>\t<model>\t<field>" -> count
USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")
_RATE_PREFIX = "flotilla:rate:"
_BUDGET_PREFIX = "flotilla:budget:"
_WINDOW_S = 60
_WINDOW_TTL_S = 3 * _WINDOW_S
_MONTH_TTL_S = 40 * 86400
#: A key's fleet totals are kept fresh this long after this process last saw it.
_KEEP_FRESH_S = 2 * _WINDOW_S
#: What a generation reserves, as refusals say it.
GENERATION_TOKENS = "its prompt and max_tokens, which defaults to the room left in the model's context"
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
    requests: int = 0  # counted here, not sent yet
    tokens: int = 0  # (reservations included)
    sent_requests: int = 0  # in the batch Redis has not acknowledged yet
    sent_tokens: int = 0

    def counts(self) -> tuple[int, int]:
        """This minute's requests and tokens, the fleet's and this process's."""
        return (
            self.fleet_requests + self.requests + self.sent_requests,
            self.fleet_tokens + self.tokens + self.sent_tokens,
        )

    def idle(self) -> bool:
        return not (self.requests or self.tokens or self.sent_requests or self.sent_tokens)


@dataclass
class _Month:
    month: str
    fleet_tokens: int = 0
    tokens: int = 0  # counted here, not sent yet
    sent_tokens: int = 0  # in the batch Redis has not acknowledged yet

    def used(self) -> int:
        return self.fleet_tokens + self.tokens + self.sent_tokens

    def idle(self) -> bool:
        return not (self.tokens or self.sent_tokens)


@dataclass
class _KeyState:
    minute: _Window
    month: _Month
    seen: float = 0.0
    #: Reservations not settled: the key is not forgotten while a request of it runs.
    open: int = 0


@dataclass
class Reservation:
    """Tokens set aside for one admitted request, in the minute and month it was admitted in, until
    ``Meter.settle`` replaces them by the tokens it used."""

    key_id: int
    tokens: int
    window: int
    month: str
    settled: bool = False


@dataclass
class _Batch:
    """One flush's counts, sent as they are until Redis acknowledges them (quota_flush.py)."""

    seq: int
    operations: Operations
    windows: list[tuple[_Window, int, int]]  # the counts it took from each minute
    months: list[tuple[_Month, int]]


@dataclass
class _Usage:
    counts: list[int] = field(default_factory=lambda: [0] * len(USAGE_FIELDS))


class Meter:
    """Counts each key's requests and tokens, refuses what is over its limits, and flushes to ``redis``
    (a ``redis.asyncio`` client; None: this process counts alone, and usage is not recorded)."""

    def __init__(self, redis: Any | None, *, clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._script = redis.register_script(SCRIPT) if redis is not None else None
        self._clock = clock
        self._keys: dict[int, _KeyState] = {}
        self._usage: dict[tuple[str, int, str], _Usage] = {}
        #: Minutes and months that ended with counts Redis has not acknowledged: they go to their own.
        self._late: dict[tuple[int, int], _Window] = {}
        self._late_months: dict[tuple[int, str], _Month] = {}
        #: The fleet totals being read for keys met for the first time (their requests wait for them).
        self._loading: dict[int, asyncio.Future[None]] = {}
        #: This process's batches: the one sent and not acknowledged, sent again until it is.
        self._marker = f"{FLUSH_PREFIX}{uuid.uuid4().hex}"
        self._seq = 0
        self._unacknowledged: _Batch | None = None
        self._flushing = asyncio.Lock()
        self._failing = RateLimitedLog(log, period_s=60.0)

    # -- the request's path: no I/O, except for a key this process does not know -------------------------

    def knows(self, key: KeyRecord) -> bool:
        """Whether ``charge`` can decide for ``key`` now; else ``load`` its fleet totals first."""
        return self._redis is None or key.key_id in self._keys or not _has_limits(key)

    async def load(self, key: KeyRecord) -> None:
        """Read ``key``'s fleet totals (this minute's, the last one's and the month's) from Redis, waiting at
        most ``LOAD_TIMEOUT_S``; the requests of the key that come meanwhile wait for the same read. When
        Redis does not answer in time (logged), the key is counted on this process's counts until a flush
        reads its totals. Never raises."""
        loading = self._loading.get(key.key_id)
        if loading is None:
            loading = self._loading[key.key_id] = asyncio.ensure_future(self._load(key.key_id))
        await asyncio.shield(loading)  # a request that leaves does not cancel the others' read

    async def _load(self, key_id: int) -> None:
        try:
            now = self._clock()
            minute, _ = _minute_of(now)
            month = _month_of(now)
            names = [
                _rate_key(key_id, minute, "r"),
                _rate_key(key_id, minute, "t"),
                _rate_key(key_id, minute - 1, "r"),
                _rate_key(key_id, minute - 1, "t"),
                _budget_key(key_id, month),
            ]
            values: list[Any] | None = None
            try:
                async with asyncio.timeout(LOAD_TIMEOUT_S):
                    values = await self._redis.mget(names)  # type: ignore[union-attr]
            except Exception as exc:  # TimeoutError, RedisError, OSError: the request goes on without them
                self._failing.warning(
                    f"API key limits: Redis did not give the fleet's totals of key {key_id} within "
                    f"{LOAD_TIMEOUT_S:g} s ({type(exc).__name__}: {exc}); its requests are counted on this "
                    "process's counts until Redis answers"
                )
            state = self._state(key_id, self._clock())
            if values is not None and state.minute.window == minute and state.month.month == month:
                window = state.minute
                requests, tokens, previous_requests, previous_tokens, budget = (int(v or 0) for v in values)
                window.fleet_requests, window.fleet_tokens = requests, tokens
                window.previous_requests, window.previous_tokens = previous_requests, previous_tokens
                state.month.fleet_tokens = budget
        finally:
            self._loading.pop(key_id, None)

    def charge(self, key: KeyRecord) -> None:
        """Count one request of ``key``, or raise RateLimited / QuotaExhausted (with Retry-After and the
        ``x-ratelimit-*`` headers) when it is over a limit (its tokens are reserved later: ``reserve``)."""
        rpm, tpm, budget = key.requests_per_minute, key.tokens_per_minute, key.monthly_token_budget
        if rpm is None and tpm is None and budget is None:
            return
        now = self._clock()
        state = self._state(key.key_id, now)
        _, fraction = _minute_of(now)
        window = state.minute
        requests_now, tokens_now = window.counts()
        requests = requests_now + window.previous_requests * (1.0 - fraction)
        tokens = tokens_now + window.previous_tokens * (1.0 - fraction)
        if rpm is not None and requests + 1 > rpm:
            wait = _wait_s(rpm - 1, requests_now, window.previous_requests, fraction)
            message = f"Rate limit reached for API key {key.name!r}: {rpm} requests per minute."
            raise _limited(RateLimited(message), wait, _headers(key, window, fraction))
        if tpm is not None and tokens >= tpm:
            wait = _wait_s(tpm - 1, tokens_now, window.previous_tokens, fraction)
            message = f"Rate limit reached for API key {key.name!r}: {tpm} tokens per minute."
            raise _limited(RateLimited(message), wait, _headers(key, window, fraction))
        if budget is not None and state.month.used() >= budget:
            message = (
                f"API key {key.name!r} used its monthly budget of {budget} tokens; it renews on the 1st (UTC), "
                "or an operator raises it."
            )
            headers = _headers(key, window, fraction)
            raise _limited(QuotaExhausted(message), _seconds_to_next_month(now), headers)
        window.requests += 1

    def limit_headers(self, key: KeyRecord) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for ``key`` as its counts stand now (this request's charge and
        reservation included); [] for a key without per-minute limits."""
        if key.requests_per_minute is None and key.tokens_per_minute is None:
            return []
        now = self._clock()
        window = self._state(key.key_id, now).minute
        _, fraction = _minute_of(now)
        return _headers(key, window, fraction)

    def reserve(
        self, key: KeyRecord, tokens: int, *, what: str = GENERATION_TOKENS, shrink: str = "lower max_tokens"
    ) -> Reservation | None:
        """Set ``tokens`` aside for a request of ``key`` (the most it may use: ``what`` they are, for the
        messages, with how to ``shrink`` them) in this minute and month; None for a key without token limits.
        Raises RateLimited or QuotaExhausted when what is used and reserved, plus these, would pass the key's
        tokens per minute or monthly budget. ``settle`` the reservation, exactly once, when the request ends."""
        tpm, budget = key.tokens_per_minute, key.monthly_token_budget
        if tpm is None and budget is None:
            return None
        now = self._clock()
        state = self._state(key.key_id, now)
        _, fraction = _minute_of(now)
        window, month = state.minute, state.month
        _, tokens_now = window.counts()
        counted = tokens_now + window.previous_tokens * (1.0 - fraction)
        if tpm is not None and counted + tokens > tpm:
            if tokens > tpm:  # no wait makes it fit: no Retry-After
                error = RateLimited(
                    f"Request too large for API key {key.name!r}: it may use {tokens} tokens ({what}), over the "
                    f"limit of {tpm} tokens per minute; {shrink}."
                )
                error.headers = _headers(key, window, fraction)
                raise error
            wait = _wait_s(tpm - tokens, tokens_now, window.previous_tokens, fraction)
            message = (
                f"Rate limit reached for API key {key.name!r}: {tpm} tokens per minute, of which "
                f"{math.ceil(counted)} are used or reserved; this request may use {tokens} ({what})."
            )
            # Its reset is when this request's tokens fit, as its Retry-After says, not when one token would.
            raise _limited(RateLimited(message), wait, _headers(key, window, fraction, tokens_wait_s=wait))
        if budget is not None and month.used() + tokens > budget:
            left = max(0, budget - month.used())
            message = (
                f"API key {key.name!r} has {left} tokens left of its monthly budget of {budget}, and this "
                f"request may use {tokens} ({what}): {shrink}, or wait for the 1st (UTC), or ask an operator "
                "to raise it."
            )
            headers = _headers(key, window, fraction)
            raise _limited(QuotaExhausted(message), _seconds_to_next_month(now), headers)
        window.tokens += tokens
        month.tokens += tokens
        state.open += 1
        return Reservation(key.key_id, tokens, window.window, month.month)

    def settle(self, reservation: Reservation | None, tokens: int) -> None:
        """End ``reservation``: its request used ``tokens`` (prompt and completion) in all, which replace
        what was set aside, in the minute and month it was admitted in. Again (or None): nothing."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        state = self._state(reservation.key_id, self._clock())
        state.open = max(0, state.open - 1)
        delta = tokens - reservation.tokens
        if not delta:
            return
        if state.minute.window == reservation.window:
            state.minute.tokens += delta
        elif state.minute.window == reservation.window + 1:
            # That minute still counts, in part: correct it here until the next flush reads it back.
            state.minute.previous_tokens += delta
            self._late_window(reservation.key_id, reservation.window).tokens += delta
        # (Earlier minutes no longer count anywhere.)
        if state.month.month == reservation.month:
            state.month.tokens += delta
        else:
            self._late_month(reservation.key_id, reservation.month).tokens += delta

    def finished(
        self,
        key: KeyRecord,
        model: str,
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        error: bool = False,
        reservation: Reservation | None = None,
    ) -> None:
        """Count a finished (or refused, ``error``) request of ``key`` on ``model``: its tokens (settling its
        ``reservation``, if it has one) and its usage."""
        now = self._clock()
        tokens = prompt_tokens + completion_tokens
        if reservation is not None:
            self.settle(reservation, tokens)
        elif tokens and (key.tokens_per_minute is not None or key.monthly_token_budget is not None):
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
            requests, tokens = old.counts()
            state.minute = _Window(
                minute, previous_requests=requests if carried else 0, previous_tokens=tokens if carried else 0
            )
            if not old.idle():
                self._late[(key_id, old.window)] = old
        if state.month.month != month:
            if not state.month.idle():
                self._late_months[(key_id, state.month.month)] = state.month
            state.month = _Month(month)
        state.seen = now
        return state

    def _late_window(self, key_id: int, window: int) -> _Window:
        found = self._late.get((key_id, window))
        if found is None:
            found = self._late[(key_id, window)] = _Window(window)
        return found

    def _late_month(self, key_id: int, month: str) -> _Month:
        found = self._late_months.get((key_id, month))
        if found is None:
            found = self._late_months[(key_id, month)] = _Month(month)
        return found

    # -- the flush: one Redis script every FLUSH_S ------------------------------------------------------------

    async def run(self) -> None:
        """Flush every ``FLUSH_S`` until cancelled."""
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def close(self) -> None:
        """Flush what is left (a clean stop loses nothing that Redis takes), and close the Redis client."""
        for loading in list(self._loading.values()):
            loading.cancel()  # a key's totals read for requests that are gone now
        # Twice: a batch in doubt goes first, alone; the counts made since follow in the second.
        if not (await self.flush() and await self.flush()):
            log.warning("stopping with counts Redis did not take: this process's last usage is lost")
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    async def flush(self) -> bool:
        """Send this process's counts and read the fleet's; False (logged) when Redis did not answer, and
        the counts are sent again, as they were, at the next flush (Redis applies them once)."""
        if self._script is None:
            return True
        async with self._flushing:
            return await self._flush()

    async def _flush(self) -> bool:
        now = self._clock()
        if self._unacknowledged is None:
            self._unacknowledged = self._batch()
        batch = self._unacknowledged
        # The objects as they are now: a minute that ends during the round trip gets new ones meanwhile.
        fresh: list[tuple[_Window, _Month]] = []
        reads: list[str] = []
        for key_id, state in self._keys.items():
            fresh.append((state.minute, state.month))
            minute = state.minute.window
            reads += [_rate_key(key_id, minute, "r"), _rate_key(key_id, minute, "t")]
            reads += [_rate_key(key_id, minute - 1, "r"), _rate_key(key_id, minute - 1, "t")]
            reads.append(_budget_key(key_id, state.month.month))
        operations = batch.operations if batch is not None else None
        args = script_args(self._marker, batch.seq if batch is not None else 0, operations, reads)
        try:
            results = await self._script(keys=[], args=args)  # type: ignore[misc]
        except Exception as exc:  # redis.exceptions.RedisError and OSError alike: nothing may stop the loop
            self._failing.warning(
                f"API key limits and usage: Redis did not take this process's counts ({exc}); kept, and sent "
                "again at the next flush"
            )
            return False
        # What was sent is the fleet's now; what was counted during the round trip stays this process's.
        if batch is not None:
            for window, requests, tokens in batch.windows:
                window.sent_requests -= requests
                window.sent_tokens -= tokens
            for month, tokens in batch.months:
                month.sent_tokens -= tokens
            self._unacknowledged = None
        values = [int(value) for value in results]
        for index, (window, month) in enumerate(fresh):
            at = index * 5
            window.fleet_requests, window.fleet_tokens = values[at], values[at + 1]
            window.previous_requests, window.previous_tokens = values[at + 2], values[at + 3]
            month.fleet_tokens = values[at + 4]
        self._forget(now)
        return True

    def _batch(self) -> _Batch | None:
        """The counts not sent yet, moved into a new batch (None: there are none)."""
        operations = Operations()
        windows: list[tuple[_Window, int, int]] = []
        months: list[tuple[_Month, int]] = []
        for key_id, state in self._keys.items():
            _take_window(operations, windows, key_id, state.minute)
            _take_month(operations, months, key_id, state.month)
        for (key_id, _), window in self._late.items():
            _take_window(operations, windows, key_id, window)
        for (key_id, _), month in self._late_months.items():
            _take_month(operations, months, key_id, month)
        usage, self._usage = self._usage, {}
        for (day, key_id, model), counts in usage.items():
            for field_name, value in zip(USAGE_FIELDS, counts.counts, strict=True):
                if value:
                    operations.add_to_hash(f"{USAGE_PREFIX}{day}", f"{key_id}\t{model}\t{field_name}", value)
        if not len(operations):
            return None
        self._seq += 1
        return _Batch(self._seq, operations, windows, months)

    def _forget(self, now: float) -> None:
        """Drop what Redis holds now: ended minutes and months, and keys idle ``_KEEP_FRESH_S``."""
        self._late = {name: window for name, window in self._late.items() if not window.idle()}
        self._late_months = {name: month for name, month in self._late_months.items() if not month.idle()}
        for key_id, state in list(self._keys.items()):
            if now - state.seen > _KEEP_FRESH_S and not state.open and state.minute.idle() and state.month.idle():
                del self._keys[key_id]


def _take_window(operations: Operations, taken: list[tuple[_Window, int, int]], key_id: int, window: _Window) -> None:
    """Move ``window``'s unsent counts into ``operations`` (noted in ``taken``, to settle on the reply)."""
    if not (window.requests or window.tokens):
        return
    for kind, value in (("r", window.requests), ("t", window.tokens)):
        if value:
            operations.add(_rate_key(key_id, window.window, kind), value, _WINDOW_TTL_S)
    taken.append((window, window.requests, window.tokens))
    window.sent_requests += window.requests
    window.sent_tokens += window.tokens
    window.requests = window.tokens = 0


def _take_month(operations: Operations, taken: list[tuple[_Month, int]], key_id: int, month: _Month) -> None:
    if month.tokens:
        operations.add(_budget_key(key_id, month.month), month.tokens, _MONTH_TTL_S)
        taken.append((month, month.tokens))
        month.sent_tokens += month.tokens
        month.tokens = 0


def _has_limits(key: KeyRecord) -> bool:
    limits = (key.requests_per_minute, key.tokens_per_minute, key.monthly_token_budget)
    return any(limit is not None for limit in limits)


def _budget_key(key_id: int, month: str) -> str:
    return f"{_BUDGET_PREFIX}{key_id}:{month}"


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


def _headers(
    key: KeyRecord, window: _Window, fraction: float, *, tokens_wait_s: float | None = None
) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers for ``key`` at ``window``'s counts, ``fraction`` into its minute.

    A reset is read off the same sliding minute as a 429's Retry-After: the seconds until one more request
    (one more token) fits, "0s" while some are left, so that a refusal's Retry-After and its reset header
    agree. ``tokens_wait_s``: a refused reservation's own wait (until its tokens fit), which its reset says.
    """
    requests_now, tokens_now = window.counts()
    headers = []
    if (rpm := key.requests_per_minute) is not None:
        requests = requests_now + window.previous_requests * (1.0 - fraction)
        wait = _wait_s(rpm - 1, requests_now, window.previous_requests, fraction)
        headers += [
            (b"x-ratelimit-limit-requests", str(rpm).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, rpm - math.ceil(requests))).encode()),
            (b"x-ratelimit-reset-requests", f"{math.ceil(wait)}s".encode()),
        ]
    if (tpm := key.tokens_per_minute) is not None:
        tokens = tokens_now + window.previous_tokens * (1.0 - fraction)
        if tokens_wait_s is None:
            tokens_wait_s = _wait_s(tpm - 1, tokens_now, window.previous_tokens, fraction)
        headers += [
            (b"x-ratelimit-limit-tokens", str(tpm).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, tpm - math.ceil(tokens))).encode()),
            (b"x-ratelimit-reset-tokens", f"{math.ceil(tokens_wait_s)}s".encode()),
        ]
    return headers


def _limited(error: GatewayError, wait_s: float, headers: list[tuple[bytes, bytes]]) -> GatewayError:
    error.retry_after = max(1, math.ceil(wait_s))
    error.headers = headers
    return error
