"""Trace replay: KV-aware routing against random and round-robin, and against NVIDIA Dynamo 1.6.1's.

Replays one trace of prefix-sharing requests, open loop (each request sent at its timestamp, whatever
the answers before it), through a FRESH stack per mode (cold caches): Flotilla random, round-robin,
kv (KV events) and kv (no events: caches predicted from routing decisions); with ``--dynamo`` also
Dynamo round-robin and kv (``--modes`` picks any, dynamo-kv-no-events included). Every stack has 4
mocker workers with the same settings (bench/stacks.py; MOCKER_SETTINGS below says why these).

    .venv/bin/python bench/trace_replay.py [--generate] [--seed 0] [--rate 56] [--duration 30]
        [--arrivals poisson|fixed] [--dynamo] [--modes flotilla-kv,dynamo-kv,...] [--overlap-weight 8]
    .venv/bin/python bench/trace_replay.py --trace bench/traces/conversations-seed0-56rps.jsonl
    .venv/bin/python bench/trace_replay.py --modes flotilla-kv --ingresses 1,2,4 --replica-sync both
    .venv/bin/python bench/trace_replay.py --modes flotilla-kv --ingresses 4 --send-to first

The default run (4 Flotilla modes of 30 s) takes ~3 minutes here, ~4.5 with ``--dynamo``.
bench/traces/conversations-seed0-56rps.jsonl is the default generated trace (seed 0, 56 requests/s,
30 s); conversations-seed0.jsonl is the earlier default (24 requests/s, 40 s, for 2048-block mockers).

The trace is JSONL like the public Mooncake traces, one request a line: ``{"timestamp": ms,
"input_length": N, "output_length": M, "hash_ids": [...]}``, where each hash id names one block of
``--trace-block-size`` tokens (Mooncake: 512); equal ids are equal content, and a request's ids are
its prefix chain. Each id becomes a fixed block of token ids (seeded by the id, from ordinary
vocabulary ids), the last block cut to ``input_length``; requests go out as streamed
``/v1/completions`` with the token ids as ``prompt``, ``max_tokens`` = ``output_length`` and
``ignore_eos``. Without ``--trace``, ``--generate`` (the default) writes a trace (see
``generate_trace``; Poisson arrivals unless ``--arrivals fixed``) to
bench/results/trace_replay_trace.jsonl and replays that. ``--overlap-weight`` sets how much both
stacks' KV routers value a cached block against a block of decode load, alike (default 8 here, where
both stacks default to 1: DEFAULT_OVERLAP_WEIGHT says why).

Prints, per mode: requests done/failed, TTFT p50/p99, inter-token latency p50/p99 (gaps between
streamed chunks that carry text: a chunk may carry several tokens), output tokens/s, prefix hit rate
(sum of ``usage.prompt_tokens_details.cached_tokens`` over sum of prompt tokens), the trace's ideal
hit rate (an infinite single cache: every block some earlier request had is a hit, counted in whole
engine blocks and never the last prompt token, as vLLM counts) and their ratio, and max/mean requests
per worker (counted from the answers: Flotilla's ``x-flotilla-instance`` header, Dynamo's
``nvext.worker_id``), the drift (TTFT p50 of the trace's second half over its first: well above 1 when
the stack is saturated and its queue grows), and the CPU each request cost the ingress and the workers
(through several ingresses, also each one's). ``--send-to first`` sends every request to the first
ingress while the others only listen: what a replica costs just by hearing the workers' KV events and
load reports and the others' decisions.
Then TTFT p50 apart for prompts at least half cached and for the others (does a gap between two
stacks come from routing, or from serving?). Then the floor checks as ratios,
bench/results/trace_replay.json, and two plots: bench/results/trace_replay_ttft.png (TTFT CDF per
mode) and trace_replay_hit_rate.png.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import random
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvloop
from _common import RESULTS_DIR, collector_paused, cpu_seconds, percentile
from prometheus_client.parser import text_string_to_metric_families
from stacks import DYNAMO_PYTHON, Stack, check_mocker_settings, dynamo_stack, flotilla_stack

RESULTS = RESULTS_DIR

# The mockers of every mode, at the timing model's own speed (speed-up 1). 64-token blocks (vLLM's
# default) divide the trace's 512-token blocks. 8192 blocks (524k tokens) per worker is what an 8B model
# leaves for KV cache on an 80 GB GPU; the default trace (56 requests/s) keeps ~1M tokens of conversation
# live, so a worker that sees every conversation (round-robin) still mostly keeps its share.
MOCKER_SETTINGS: dict[str, Any] = {"block_size": 64, "num_gpu_blocks": 8192, "speedup_ratio": 1.0}
#: The default trace's rate: round-robin is busy there but not saturated. Its TTFT p50, measured with
#: these settings: 80 ms at 32 requests/s, 99 at 48, 160-168 at 56 (inter-token p50 54 ms against 8 at 32;
#: the second half of the run no slower than the first, so its queue does not grow).
DEFAULT_RATE = 56.0
#: Both stacks' KV routers weigh a block left to prefill 8x a block of decode load (both default to 1).
#: With these settings a computed 64-token block costs ~1 ms of prefill (timing.py), while holding one
#: adds 54/8192 ms to each decode step (decode cost grows 54 ms from empty to full KV), ~0.26 ms over
#: an answer's ~40 steps: 4x. Measured, 8 does better still, for both stacks (TTFT p50 ~63 ms against
#: ~76 at 4, hit rate 0.71-0.73 against 0.67-0.69): a prompt computed again also delays every request
#: queued behind it on that worker, which the per-request estimate leaves out.
DEFAULT_OVERLAP_WEIGHT = 8.0
WORKERS = 4
# Ordinary vocabulary ids of SmolLM2 (49152 tokens): no special or control tokens.
_TOKEN_LOW, _TOKEN_HIGH = 1000, 40000


# --- the trace ---------------------------------------------------------------------------------------


class TraceRequest(msgspec.Struct, frozen=True):
    timestamp: float  # ms from the trace's start
    input_length: int
    output_length: int
    hash_ids: list[int]


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line and the field."""


def load_trace(path: Path, block_size: int) -> list[TraceRequest]:
    """The requests of the JSONL trace at ``path``, by timestamp. Raises TraceError naming line and field."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"--trace {path}: cannot be read: {exc.strerror}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = msgspec.json.decode(line, type=TraceRequest)
        except msgspec.DecodeError as exc:  # ValidationError included: it names the field ("at `$.…`")
            raise TraceError(f"--trace {path}, line {number}: {exc}") from None
        if request.input_length < 1 or request.output_length < 1:
            raise TraceError(f"--trace {path}, line {number}: input_length and output_length must be at least 1")
        if len(request.hash_ids) * block_size < request.input_length:
            raise TraceError(
                f"--trace {path}, line {number}: {len(request.hash_ids)} hash_ids of {block_size} tokens "
                f"cannot cover input_length {request.input_length} (--trace-block-size?)"
            )
        requests.append(request)
    if not requests:
        raise TraceError(f"--trace {path}: no requests")
    return sorted(requests, key=lambda request: request.timestamp)


def write_trace(path: Path, trace: Sequence[TraceRequest]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(msgspec.json.encode(request) + b"\n" for request in trace))


@dataclass(frozen=True)
class TrafficShape:
    """What the generator draws from (token counts unless named otherwise; ranges are inclusive)."""

    system_prompts: int = 4
    system_blocks: tuple[int, int] = (1, 3)  # whole trace blocks per system prompt
    turns: tuple[int, int] = (4, 10)
    first_message: tuple[int, int] = (2000, 4000)  # a question with a document or code pasted in
    message: tuple[int, int] = (50, 300)
    output: tuple[int, int] = (16, 64)
    think_s: tuple[float, float] = (2.0, 6.0)  # seconds from a turn's arrival to the earliest next turn
    max_prompt: int = 7500  # a conversation ends before its prompt would pass this (SmolLM2: 8192 context)


@dataclass
class _Conversation:
    hash_ids: list[int]
    input_length: int
    output_length: int
    turns_left: int
    next_at: float


def generate_trace(
    *, seed: int, rate: float, duration: float, block_size: int, arrivals: str, shape: TrafficShape = TrafficShape()
) -> list[TraceRequest]:
    """Prefix-sharing traffic: a few shared system prompts, and multi-turn conversations that open on one.

    Requests arrive at ``rate`` per second for ``duration`` seconds, with exponential gaps
    (``arrivals="poisson"``) or evenly spaced (``"fixed"``). At each arrival the conversation that
    has waited longest past its think time sends its next turn; if none is ready, a new one starts.
    A turn's prompt is the previous turn's prompt, its answer and a new user message, so its hash ids
    are the previous prompt's whole blocks plus new ones (the previous last, partial block grows into
    new content). Deterministic for a given seed.
    """
    rng = random.Random(seed)
    next_id = 0

    def new_ids(count: int) -> list[int]:
        nonlocal next_id
        next_id += count
        return list(range(next_id - count, next_id))

    systems = [new_ids(rng.randint(*shape.system_blocks)) for _ in range(shape.system_prompts)]
    live: list[_Conversation] = []
    trace: list[TraceRequest] = []
    now = 0.0
    while True:
        now += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
        if now >= duration:
            return trace
        ready = [c for c in live if c.next_at <= now]
        if ready:
            conversation = min(ready, key=lambda c: c.next_at)
            full = conversation.input_length // block_size
            length = conversation.input_length + conversation.output_length + rng.randint(*shape.message)
            conversation.hash_ids = conversation.hash_ids[:full] + new_ids(math.ceil(length / block_size) - full)
            conversation.input_length = length
        else:
            system = rng.choice(systems)
            length = len(system) * block_size + rng.randint(*shape.first_message)
            conversation = _Conversation(
                system + new_ids(math.ceil(length / block_size) - len(system)), length, 0, rng.randint(*shape.turns), 0
            )
            live.append(conversation)
        conversation.output_length = rng.randint(*shape.output)
        conversation.turns_left -= 1
        conversation.next_at = now + rng.uniform(*shape.think_s)
        trace.append(TraceRequest(round(now * 1000, 3), length, conversation.output_length, conversation.hash_ids))
        # Done, or the next turn (this answer and a message, at their longest, and a message to spare)
        # could pass max_prompt.
        if conversation.turns_left == 0 or length + shape.output[1] + shape.message[1] * 2 > shape.max_prompt:
            live.remove(conversation)


class BlockTokens:
    """Token ids for hash ids: each id names one fixed block of ordinary vocabulary ids, seeded by the id."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        if (tokens := self._blocks.get(hash_id)) is None:
            draw = random.Random(hash_id).randrange
            tokens = self._blocks[hash_id] = [draw(_TOKEN_LOW, _TOKEN_HIGH) for _ in range(self.block_size)]
        return tokens

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's prompt: its blocks in order, cut to ``input_length``."""
        blocks = math.ceil(request.input_length / self.block_size)
        tokens = [token for hash_id in request.hash_ids[:blocks] for token in self.block(hash_id)]
        return tokens[: request.input_length]


def ideal_cached_tokens(trace: Sequence[TraceRequest], trace_block: int, engine_block: int) -> list[int]:
    """Per request, the prompt tokens an infinite cache shared by all workers would hold.

    A block counts as far as some earlier request had its content; the hit is the leading run of such
    tokens, cut to whole engine blocks and never the last prompt token (vLLM computes that one anyway).
    """
    seen: dict[int, int] = {}  # hash id -> most of its tokens any earlier request had
    ideal = []
    for request in trace:
        hit = 0
        spans = [
            (hash_id, min(trace_block, request.input_length - index * trace_block))
            for index, hash_id in enumerate(request.hash_ids)
            if index * trace_block < request.input_length
        ]
        for hash_id, tokens in spans:
            covered = min(tokens, seen.get(hash_id, 0))
            hit += covered
            if covered < tokens:
                break
        ideal.append(min(hit, request.input_length - 1) // engine_block * engine_block)
        for hash_id, tokens in spans:
            seen[hash_id] = max(seen.get(hash_id, 0), tokens)
    return ideal


# --- one streamed request ----------------------------------------------------------------------------


@dataclass
class StreamResult:
    """One streamed request as the client saw it; ``error`` is None when it completed."""

    sent: float  # time.perf_counter() when sent
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    finished: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    def gaps(self) -> list[float]:
        times = self.token_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]


def http_request(port: int, path: str, body: Mapping[str, Any], *, keep_alive: bool) -> bytes:
    """The raw bytes of a JSON POST to ``path`` on 127.0.0.1:``port``."""
    payload = msgspec.json.encode(body)
    connection = "" if keep_alive else "Connection: close\r\n"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n{connection}\r\n"
    )
    return head.encode() + payload


_decode_event = msgspec.json.Decoder().decode


async def read_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> StreamResult:
    """Send ``request`` on the connection and read its SSE answer (chunked) to the end.

    Network errors propagate (OSError, asyncio.IncompleteReadError); a non-200 answer, an error event
    or a stream without ``[DONE]`` come back as ``error``.
    """
    result = StreamResult(time.perf_counter())
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:] if line)}
    result.worker = headers.get("x-flotilla-instance")
    if status != 200:
        length = int(headers.get("content-length", "0"))
        body = await (reader.readexactly(length) if length else reader.read(4096))
        result.error = f"HTTP {status}: {body[:200].decode(errors='replace')}"
        return result
    buffer = b""
    done = False
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        buffer += (await reader.readexactly(size + 2))[:-2]
        now = time.perf_counter()
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = event.strip().removeprefix(b"data:").strip()
            if data == b"[DONE]":
                done = True
            elif data.startswith(b"{"):
                _take_event(result, _decode_event(data), now)
    result.finished = time.perf_counter()
    if result.error is None and not done:
        result.error = "stream ended without [DONE]"
    return result


def _take_event(result: StreamResult, event: dict[str, Any], now: float) -> None:
    if "error" in event:
        result.error = f"error event: {str(event['error'])[:200]}"
        return
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            result.token_times.append(now)
            break
    if usage := event.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.completion_tokens = usage.get("completion_tokens", 0)
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if result.worker is None and (worker := (event.get("nvext") or {}).get("worker_id")):
        result.worker = str(worker.get("decode_worker_id"))


async def send_one(port: int, request: bytes, expected_tokens: int, patience: float) -> StreamResult:
    """One request on a connection of its own; a failure of any kind comes back as ``error``."""
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(patience):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                result = await read_stream(reader, writer, request)
            finally:
                writer.close()
    except TimeoutError:
        return StreamResult(sent, error=f"no answer within {patience:.0f}s")
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return StreamResult(sent, error=type(exc).__name__)
    if result.error is None and result.completion_tokens != expected_tokens:
        result.error = f"{result.completion_tokens} of {expected_tokens} tokens"
    if result.error is None and not result.token_times:
        result.error = "no text"
    return result


async def replay(
    ports: Sequence[int], requests: Sequence[bytes], trace: Sequence[TraceRequest], patience: float
) -> tuple[list[StreamResult], float]:
    """Send each request at its trace time (open loop), to the ingresses' ``ports`` in turn (as a load
    balancer would); returns the results in trace order, and wall seconds."""
    start = time.perf_counter()
    tasks = []
    for number, (request, entry) in enumerate(zip(requests, trace, strict=True)):
        await asyncio.sleep(max(0.0, start + entry.timestamp / 1000 - time.perf_counter()))
        port = ports[number % len(ports)]
        tasks.append(asyncio.create_task(send_one(port, request, entry.output_length, patience)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


# --- modes and what they measure ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str
    stack: str  # "flotilla" or "dynamo"
    router_mode: str
    use_kv_events: bool = True
    ingresses: int = 1  # ingress processes (Dynamo: frontends), each sent every Nth request (--ingresses)
    replica_sync: bool = True  # kv through several: --router-replica-sync (--replica-sync), Flotilla's or Dynamo's


MODES = {
    mode.name: mode
    for mode in (
        Mode("flotilla-random", "flotilla", "random"),
        Mode("flotilla-round-robin", "flotilla", "round-robin"),
        Mode("flotilla-kv", "flotilla", "kv"),
        Mode("flotilla-kv-no-events", "flotilla", "kv", use_kv_events=False),
        Mode("dynamo-round-robin", "dynamo", "round-robin"),
        Mode("dynamo-kv", "dynamo", "kv"),
        Mode("dynamo-kv-no-events", "dynamo", "kv", use_kv_events=False),
    )
}
#: What runs without --modes: every Flotilla mode, and with --dynamo Dynamo's round-robin and kv.
DEFAULT_MODES = ("flotilla-random", "flotilla-round-robin", "flotilla-kv", "flotilla-kv-no-events")
DYNAMO_MODES = ("dynamo-round-robin", "dynamo-kv")


@contextlib.contextmanager
def start_stack(
    mode: Mode,
    settings: Mapping[str, Any],
    overlap_weight: float,
    ingress_args: Sequence[str],
    dynamo_args: Sequence[str],
) -> Iterator[Stack]:
    """A fresh stack for ``mode``; ``ingress_args`` go to Flotilla's ingress, ``dynamo_args`` to Dynamo's frontend."""
    common: dict[str, Any] = {
        "workers": WORKERS, "mocker_settings": settings, "router_mode": mode.router_mode,
        "use_kv_events": mode.use_kv_events, "overlap_weight": overlap_weight,
    }  # fmt: skip
    if mode.stack == "flotilla":
        sync = ["--router-replica-sync", "true" if mode.replica_sync else "false"]
        with flotilla_stack(**common, ingress_args=[*sync, *ingress_args], ingresses=mode.ingresses) as stack:
            yield stack
    else:
        with dynamo_stack(
            **common, frontend_args=dynamo_args, frontends=mode.ingresses, replica_sync=mode.replica_sync
        ) as stack:
            yield stack


def summarize(
    results: Sequence[StreamResult], seconds: float, stack: Stack, ideal: float, trace: Sequence[TraceRequest]
) -> dict[str, Any]:
    """The numbers of one mode (times in ms)."""
    done = [r for r in results if r.error is None]
    ttfts = [r.ttft * 1000 for r in done]
    gaps = [gap * 1000 for r in done for gap in r.gaps()]
    prompt = sum(r.prompt_tokens for r in done)
    hit_rate = sum(r.cached_tokens for r in done) / prompt if prompt else 0.0
    per_worker = Counter(r.worker for r in done)
    loads = [per_worker.get(worker, 0) for worker in stack.worker_ids]
    unknown = sum(count for worker, count in per_worker.items() if worker not in stack.worker_ids)
    mean_load = sum(loads) / len(loads) if loads else 0.0

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    # Saturation shows as a queue that grows through the run: the second half's TTFT p50 well above the
    # first half's. A busy but stable stack keeps the two close.
    middle = trace[-1].timestamp / 2
    halves = [
        [
            r.ttft * 1000
            for r, entry in zip(results, trace, strict=True)
            if r.error is None and late == (entry.timestamp >= middle)
        ]
        for late in (False, True)
    ]
    first, second = pct(halves[0], 50), pct(halves[1], 50)

    return {
        "requests": len(results),
        "done": len(done),
        "failed": len(results) - len(done),
        "failures": dict(Counter(r.error for r in results if r.error is not None).most_common(5)),
        "ttft_p50_ms": pct(ttfts, 50),
        "ttft_p99_ms": pct(ttfts, 99),
        "ttft_p50_drift": second / first if first and second is not None else None,
        # Whether a gap between two stacks comes from routing (fewer hits) or from serving (slower hits).
        "ttft_p50_mostly_cached_ms": pct([r.ttft * 1000 for r in done if r.cached_tokens * 2 >= r.prompt_tokens], 50),
        "ttft_p50_mostly_computed_ms": pct([r.ttft * 1000 for r in done if r.cached_tokens * 2 < r.prompt_tokens], 50),
        "itl_p50_ms": pct(gaps, 50),
        "itl_p99_ms": pct(gaps, 99),
        "output_tokens_per_s": sum(r.completion_tokens for r in done) / seconds,
        "hit_rate": hit_rate,
        "ideal_hit_rate": ideal,
        "hit_over_ideal": hit_rate / ideal if ideal else None,
        "requests_per_worker": loads,
        "requests_from_unknown_workers": unknown,
        "max_over_mean_load": max(loads) / mean_load if mean_load else None,
        "prompt_tokens_mismatched": sum(
            1
            for r, entry in zip(results, trace, strict=True)
            if r.error is None and r.prompt_tokens != entry.input_length
        ),
        "seconds": seconds,
        "ttfts_ms": sorted(ttfts),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summaries: Mapping[str, dict[str, Any]]) -> None:
    print(
        f"{'mode':24}{'done':>6}{'fail':>5}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}"
        f"{'out tok/s':>10}{'hit':>7}{'ideal':>7}{'ratio':>7}{'max/mean':>9}{'drift':>7}{'CPU in/wk':>11}"
    )
    for name, s in summaries.items():
        print(
            f"{name:24}{s['done']:6d}{s['failed']:5d}{_fmt(s['ttft_p50_ms'], '10.1f')}{_fmt(s['ttft_p99_ms'], '9.1f')}"
            f"{_fmt(s['itl_p50_ms'], '9.1f')}{_fmt(s['itl_p99_ms'], '8.1f')}{s['output_tokens_per_s']:10.0f}"
            f"{s['hit_rate']:7.3f}{s['ideal_hit_rate']:7.3f}{_fmt(s['hit_over_ideal'], '7.2f')}"
            f"{_fmt(s['max_over_mean_load'], '9.2f')}{_fmt(s['ttft_p50_drift'], '7.2f')}"
            f"{s['ingress_cpu_ms_per_request']:6.1f}/{s['workers_cpu_ms_per_request']:<4.1f}"
        )
    for name, s in summaries.items():
        print(
            f"  {name}: TTFT p50 {_fmt(s['ttft_p50_mostly_cached_ms'], '.1f')} ms for prompts at least half cached, "
            f"{_fmt(s['ttft_p50_mostly_computed_ms'], '.1f')} ms for the others"
        )
    print(
        "(times in ms; ITL = gaps between streamed chunks with text; load = requests per worker; drift = TTFT p50"
        " of the trace's second half over its first half, ~1 when the queue is stable; CPU = ms per request of"
        " the ingress / of all workers)"
    )
    for name, s in summaries.items():
        if s["failures"]:
            print(f"  {name} failures: {s['failures']}")
        if s["requests_from_unknown_workers"] or s["prompt_tokens_mismatched"]:
            print(
                f"  {name}: {s['requests_from_unknown_workers']} answers named no known worker, "
                f"{s['prompt_tokens_mismatched']} had prompt_tokens != input_length"
            )


def floor_checks(summaries: Mapping[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each floor as a ratio (None where a mode it needs was not run), printed with its bound."""

    def ratio(numerator: Callable[[], float | None], denominator: Callable[[], float | None]) -> float | None:
        try:
            top, bottom = numerator(), denominator()
        except KeyError:
            return None
        return top / bottom if top is not None and bottom else None

    def get(mode: str, key: str) -> Callable[[], float | None]:
        return lambda: summaries[mode][key]

    one = lambda: 1.0  # noqa: E731
    checks = {
        "kv TTFT p50 / round-robin TTFT p50": (
            ratio(get("flotilla-kv", "ttft_p50_ms"), get("flotilla-round-robin", "ttft_p50_ms")), "<=", 0.5),
        "kv hit rate / ideal": (ratio(get("flotilla-kv", "hit_over_ideal"), one), ">=", 0.8),
        "kv max/mean requests per worker": (ratio(get("flotilla-kv", "max_over_mean_load"), one), "<=", 1.3),
        "Flotilla kv / Dynamo kv TTFT p50": (
            ratio(get("flotilla-kv", "ttft_p50_ms"), get("dynamo-kv", "ttft_p50_ms")), "<=", 1.0),
        "Flotilla kv / Dynamo kv TTFT p99": (
            ratio(get("flotilla-kv", "ttft_p99_ms"), get("dynamo-kv", "ttft_p99_ms")), "<=", 1.0),
    }  # fmt: skip
    print("floors:")
    for name, (value, sense, bound) in checks.items():
        if value is None:
            print(f"  {name}: not measured (a mode it needs was not run)")
            continue
        met = value <= bound if sense == "<=" else value >= bound
        print(f"  {name}: {value:.2f} (floor {sense} {bound}: {'met' if met else 'NOT met'})")
    return {name: value for name, (value, _, _) in checks.items()}


def save_plots(summaries: Mapping[str, dict[str, Any]], ideal: float) -> list[Path]:
    """TTFT CDF per mode, and hit rate per mode against the ideal; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [RESULTS / "trace_replay_ttft.png", RESULTS / "trace_replay_hit_rate.png"]
    figure, axes = plt.subplots(figsize=(8, 5))
    for name, s in summaries.items():
        values = s["ttfts_ms"]
        if values:
            axes.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (ms, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title("TTFT per routing mode (same trace, fresh stack each)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(paths[0], dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(8, 5))
    names = list(summaries)
    axes.bar(names, [summaries[name]["hit_rate"] for name in names], color="tab:blue")
    axes.axhline(ideal, color="tab:red", linestyle="--", label=f"ideal (infinite shared cache): {ideal:.3f}")
    axes.set_ylabel("prefix hit rate (cached / prompt tokens)")
    axes.set_ylim(0, 1)
    axes.set_title("Prefix hit rate per routing mode")
    axes.tick_params(axis="x", labelrotation=20)
    axes.legend()
    figure.tight_layout()
    figure.savefig(paths[1], dpi=120)
    plt.close(figure)
    return paths


def ingress_variants(modes: Sequence[Mode], counts: Sequence[int], replica_sync: str) -> Iterator[Mode]:
    """Each mode through each count of ingress processes, with replica sync on and/or off (kv modes).

    Names gain ``-xN`` when more than one count is listed or N > 1, and ``-sync``/``-nosync`` with
    ``replica_sync="both"``; the defaults (one process, sync on) keep the mode's own name.
    """
    syncs = {"on": (True,), "off": (False,), "both": (True, False)}[replica_sync]
    for mode in modes:
        for count in counts:
            for sync in syncs if mode.router_mode == "kv" else (True,):
                name = mode.name
                if len(counts) > 1 or count > 1:
                    name += f"-x{count}"
                if len(syncs) > 1 and mode.router_mode == "kv":
                    name += "-sync" if sync else "-nosync"
                yield dataclasses.replace(mode, name=name, ingresses=count, replica_sync=sync)


def ingress_ratios(modes: Sequence[Mode], summaries: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per run through several ingress processes (or without replica sync): its hit rate and TTFT p50 and
    p99 over those of its mode's run through one process with replica sync (printed too)."""
    ratios: dict[str, dict[str, float]] = {}
    baseline_of = {
        (mode.router_mode, mode.use_kv_events, mode.stack): mode.name
        for mode in reversed(modes)
        if mode.ingresses == 1 and mode.replica_sync
    }
    for mode in modes:
        base_name = baseline_of.get((mode.router_mode, mode.use_kv_events, mode.stack))
        if base_name is None or base_name == mode.name or mode.name not in summaries:
            continue
        run, base = summaries[mode.name], summaries[base_name]
        ratios[mode.name] = {
            key: run[key] / base[key]
            for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")
            if run[key] is not None and base[key]
        }
    if ratios:
        print("against one ingress process (same mode, replica sync on):")
        print(f"  {'run':36}{'hit rate':>10}{'TTFT p50':>10}{'p99':>8}")
        for name, values in ratios.items():
            print(
                f"  {name:36}{_fmt(values.get('hit_rate'), '10.3f')}{_fmt(values.get('ttft_p50_ms'), '10.3f')}"
                f"{_fmt(values.get('ttft_p99_ms'), '8.3f')}"
            )
    for name, summary in summaries.items():
        if len(each := summary.get("each_ingress_cpu_ms_per_request", ())) > 1:
            print(f"  {name}: CPU per request of the trace, each ingress: {', '.join(f'{ms:.2f}' for ms in each)} ms")
        if delay := summary.get("replica_sync_delay"):
            print(
                f"  {name}: the other replicas' decisions arrived after {_fmt(delay['mean_ms'], '.1f')} ms on"
                f" average (p50 under {_fmt(delay['p50_ms'], 'g')} ms, p90 under {_fmt(delay['p90_ms'], 'g')} ms);"
                f" the replicas published {_fmt(delay.get('messages_per_request'), '.2f')} messages per request"
            )
    return ratios


def replica_sync_delay(ports: Sequence[int]) -> dict[str, float | None] | None:
    """How late the replicas' decisions reached each other, from the ingresses' own histogram
    (``flotilla_router_replica_sync_delay_seconds``, summed over them): mean, and the p50 and p90 as the
    bucket bounds they fall under, in ms, and how many batches were heard; None if no ingress measured any."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != "flotilla_router_replica_sync_delay_seconds":
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value

    def bound(share: float) -> float | None:
        reached = [le for le in sorted(buckets) if buckets[le] >= share * count]
        return reached[0] * 1000 if reached else None

    if not count:
        return None
    return {"mean_ms": total / count * 1000, "p50_ms": bound(0.5), "p90_ms": bound(0.9), "batches": count}


# --- main --------------------------------------------------------------------------------------------


def run_mode(
    mode: Mode, args: argparse.Namespace, prompts: Sequence[list[int]], trace: Sequence[TraceRequest], ideal: float
) -> dict[str, Any]:
    """Replay ``trace`` through a fresh stack for ``mode``; its summary. Raises RuntimeError if it does not start."""
    started = time.monotonic()
    with start_stack(
        mode, args.settings, args.overlap_weight, args.ingress_args.split(), args.dynamo_args.split()
    ) as stack:
        up = time.monotonic() - started
        requests = [
            http_request(
                stack.port, "/v1/completions",
                {"model": stack.model, "prompt": prompt, "max_tokens": r.output_length, "ignore_eos": True,
                 "stream": True, "stream_options": {"include_usage": True}, **stack.worker_fields},
                keep_alive=False,
            )
            for prompt, r in zip(prompts, trace, strict=True)
        ]  # fmt: skip
        syncing = mode.stack == "flotilla" and mode.replica_sync and mode.ingresses > 1
        heard_before = ((replica_sync_delay(stack.ports) or {}).get("batches") or 0.0) if syncing else 0.0
        cpu_before = [cpu_seconds(pid) for pid in (*stack.ingress_pids, *stack.worker_pids)]
        ports = stack.ports or (stack.port,)
        with collector_paused():
            results, seconds = uvloop.run(
                replay(ports[:1] if args.send_to == "first" else ports, requests, trace, args.patience)
            )
        cpu = [
            cpu_seconds(pid) - before
            for pid, before in zip((*stack.ingress_pids, *stack.worker_pids), cpu_before, strict=True)
        ]
        ingress_cpu = sum(cpu[: len(stack.ingress_pids)])
        delay = replica_sync_delay(stack.ports) if syncing else None
        if delay is not None:
            # Every batch one replica publishes is heard by each of the others.
            heard = (delay["batches"] or 0.0) - heard_before
            delay["messages_per_request"] = heard / (mode.ingresses - 1) / len(trace)
        return {
            "replica_sync_delay": delay,
            **summarize(results, seconds, stack, ideal, trace),
            "stack_up_s": up,
            "ingress_cpu_ms_per_request": ingress_cpu / len(trace) * 1000,
            "each_ingress_cpu_ms_per_request": [spent / len(trace) * 1000 for spent in cpu[: len(stack.ingress_pids)]],
            "workers_cpu_ms_per_request": (sum(cpu) - ingress_cpu) / len(trace) * 1000,
        }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="replay this JSONL trace (Mooncake's format)")
    source.add_argument("--generate", action="store_true", help="generate the trace (the default)")
    parser.add_argument("--seed", type=int, default=0, help="--generate: random seed")
    parser.add_argument(
        "--rate", type=float, default=DEFAULT_RATE, help=f"--generate: requests per second (default {DEFAULT_RATE:g})"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of trace to replay per mode")
    parser.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson", help="--generate: arrival gaps")
    parser.add_argument(
        "--document-tokens", default="2000-4000", metavar="LOW-HIGH",
        help="--generate: tokens of the document or code a conversation opens with (default 2000-4000); "
        "longer ones make a cache miss cost more against a hit",
    )  # fmt: skip
    parser.add_argument("--trace-block-size", type=int, default=512, help="tokens per hash id (Mooncake: 512)")
    parser.add_argument("--dynamo", action="store_true", help="also replay through Dynamo (round-robin, kv)")
    parser.add_argument("--modes", help=f"comma-separated modes to run, in order, from: {', '.join(MODES)}")
    parser.add_argument("--mocker", default="{}", help="JSON object of mocker settings over the defaults")
    parser.add_argument(
        "--overlap-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT,
        help=f"kv modes: a block left to prefill against a block of decode load (Flotilla's "
        f"--kv-overlap-score-weight, Dynamo's --router-prefill-load-scale; default {DEFAULT_OVERLAP_WEIGHT:g} "
        "here, see DEFAULT_OVERLAP_WEIGHT; both stacks default to 1)",
    )  # fmt: skip
    parser.add_argument(
        "--ingress-args", default="", help="extra flags for Flotilla's ingress, e.g. '--kv-overlap-score-weight 2'"
    )
    parser.add_argument("--dynamo-args", default="", help="extra flags for Dynamo's frontend")
    parser.add_argument("--patience", type=float, default=120.0, help="longest wait for one answer, seconds")
    parser.add_argument(
        "--warmup", type=float, default=5.0, metavar="SECONDS",
        help="replay the trace's first SECONDS through a throwaway stack of the first mode before measuring: "
        "the first replay of a run is slow, whatever its mode (default 5; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--ingresses", default="1", metavar="N[,N...]",
        help="run each mode through N ingress processes (Dynamo: frontends), each sent every Nth request, as replicas "
        "behind a load balancer), for each N listed, e.g. 1,2,4; with more than one N, the table ends with "
        "each run's hit rate and TTFT as ratios to its mode's run through one process (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--send-to", choices=("all", "first"), default="all",
        help="through several ingresses: all: each takes every Nth request; first: the first takes every request "
        "and the others only listen (what hearing the KV events and the other replicas costs one) (default all)",
    )  # fmt: skip
    parser.add_argument(
        "--replica-sync", choices=("on", "off", "both"), default="on",
        help="kv modes through several ingresses: their --router-replica-sync (Flotilla's, or Dynamo's own); both: "
        "run each way (default on)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.rate <= 0 or args.duration <= 0 or args.trace_block_size < 1:
        parser.error("--rate and --duration must be above 0, --trace-block-size at least 1")
    try:
        low, high = (int(part) for part in args.document_tokens.split("-"))
    except ValueError:
        parser.error(f"--document-tokens: expected LOW-HIGH token counts, like 2000-4000, not {args.document_tokens!r}")
    if not 1 <= low <= high <= TrafficShape.max_prompt - 1000:
        parser.error(f"--document-tokens: need 1 <= LOW <= HIGH <= {TrafficShape.max_prompt - 1000}")
    args.shape = TrafficShape(first_message=(low, high))
    if args.modes:
        args.mode_list = [MODES[name] for name in args.modes.split(",") if name in MODES]
        if unknown := [name for name in args.modes.split(",") if name not in MODES]:
            parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    else:
        args.mode_list = [MODES[name] for name in DEFAULT_MODES + (DYNAMO_MODES if args.dynamo else ())]
    try:
        counts = [int(part) for part in args.ingresses.split(",")]
    except ValueError:
        parser.error(f"--ingresses: expected counts like 1,2,4, not {args.ingresses!r}")
    if not counts or min(counts) < 1 or max(counts) > 16:
        parser.error("--ingresses: each count must be between 1 and 16")
    args.mode_list = list(ingress_variants(args.mode_list, counts, args.replica_sync))
    try:
        args.settings = {**MOCKER_SETTINGS, **json.loads(args.mocker)}
    except (json.JSONDecodeError, TypeError) as exc:
        parser.error(f"--mocker: not a JSON object: {exc}")
    dynamo = any(mode.stack == "dynamo" for mode in args.mode_list)
    if dynamo and not DYNAMO_PYTHON.exists():
        parser.error(f"no Dynamo at {DYNAMO_PYTHON}: run `make dynamo`, or set DYNAMO_PYTHON")
    try:
        check_mocker_settings(args.settings, dynamo=dynamo)
    except ValueError as exc:
        parser.error(f"--mocker: {exc}")
    try:
        if args.trace:
            trace = load_trace(args.trace, args.trace_block_size)
            args.trace_requests = [r for r in trace if r.timestamp - trace[0].timestamp < args.duration * 1000]
        else:
            args.trace_requests = generate_trace(
                seed=args.seed, rate=args.rate, duration=args.duration,
                block_size=args.trace_block_size, arrivals=args.arrivals, shape=args.shape,
            )  # fmt: skip
    except TraceError as exc:
        parser.error(str(exc))
    return args


def main() -> None:
    args = parse_args()
    trace: list[TraceRequest] = args.trace_requests
    if not args.trace:
        args.trace = RESULTS / "trace_replay_trace.jsonl"
        write_trace(args.trace, trace)
    start = trace[0].timestamp
    trace = [msgspec.structs.replace(r, timestamp=r.timestamp - start) for r in trace]
    engine_block = int(args.settings["block_size"])
    if args.trace_block_size % engine_block:
        print(f"warning: trace blocks of {args.trace_block_size} tokens do not split into engine blocks of "
              f"{engine_block}: shared blocks will not line up", file=sys.stderr)  # fmt: skip
    ideal_tokens = ideal_cached_tokens(trace, args.trace_block_size, engine_block)
    ideal = sum(ideal_tokens) / sum(r.input_length for r in trace)
    tokens = BlockTokens(args.trace_block_size)
    prompts = [tokens.prompt(r) for r in trace]
    print(
        f"trace {args.trace}: {len(trace)} requests over {trace[-1].timestamp / 1000:.1f} s, prompts "
        f"{min(r.input_length for r in trace)}-{max(r.input_length for r in trace)} tokens, outputs "
        f"{min(r.output_length for r in trace)}-{max(r.output_length for r in trace)}, ideal hit rate {ideal:.3f}"
    )
    print(f"{WORKERS} mocker workers per stack, settings {json.dumps(args.settings)}")
    summaries: dict[str, dict[str, Any]] = {}
    began = time.monotonic()
    if args.warmup > 0:
        # The first replay of a run was slow whatever its mode (TTFT p50 2-10x a later run of the same mode,
        # its first half slowest): a short replay through a throwaway stack first, so that no mode pays it.
        head = [r for r in trace if r.timestamp < args.warmup * 1000]
        try:
            run_mode(args.mode_list[0], args, prompts[: len(head)], head, ideal)
        except RuntimeError as exc:
            sys.exit(f"warm-up: {exc}")
        print(f"warm-up: {len(head)} requests through {args.mode_list[0].name}, discarded", flush=True)
    for number, mode in enumerate(args.mode_list, 1):
        started = time.monotonic()
        try:
            summaries[mode.name] = run_mode(mode, args, prompts, trace, ideal)
        except RuntimeError as exc:  # a stack that did not come up: the logs in the message say why
            sys.exit(f"{mode.name}: {exc}")
        s = summaries[mode.name]
        print(
            f"[{number}/{len(args.mode_list)}] {mode.name}: {s['done']} done, {s['failed']} failed, "
            f"TTFT p50 {_fmt(s['ttft_p50_ms'], '.1f')} ms, hit rate {s['hit_rate']:.3f} "
            f"(stack up in {s['stack_up_s']:.1f} s, mode took {time.monotonic() - started:.0f} s, "
            f"{time.monotonic() - began:.0f} s so far)",
            flush=True,
        )
    print()
    print_table(summaries)
    ratios = ingress_ratios(args.mode_list, summaries)
    floors = floor_checks(summaries)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "trace_replay.json"
    arguments = {k: str(v) for k, v in vars(args).items() if k not in ("trace_requests", "mode_list", "settings")}
    out.write_text(
        json.dumps(
            {"args": arguments, "mocker_settings": args.settings, "workers": WORKERS, "ideal_hit_rate": ideal,
             "modes": summaries, "floors": floors, "ingress_ratios": ratios},
            indent=1,
        )
    )  # fmt: skip
    plots = save_plots(summaries, ideal)
    print(f"wrote {out}, {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    main()
