"""Flotilla's whole stack against NVIDIA Dynamo 1.6.1's, side by side, on the same load.

Each stack is an ingress and 2 mocker workers at speed-up 1000 (the mockers wait ~nothing: the
serving path is what is measured), round-robin routing (bench/stacks.py: Flotilla on its own etcd
and NATS; Dynamo with file discovery, the TCP request plane and NATS events). Each is driven by a
closed loop of ``--concurrency`` keep-alive connections sending streamed chat completions of
``--tokens`` tokens (``ignore_eos``) back to back for ``--seconds``, after an unmeasured warm-up; the
stacks take turns, in alternating order, for ``--rounds`` rounds, each on a fresh stack.

    .venv/bin/python bench/stack_vs_dynamo.py [--seconds 8] [--rounds 2] [--concurrency 32] [--tokens 32]
        [--paced-share 0.8] [--stacks flotilla,dynamo]

Then both stacks again, paced: requests due at one rate for both (``--paced-share`` of the slower
stack's closed-loop requests/s), on at most ``--concurrency`` connections, each request's TTFT counted
from when it was due. A closed loop loads each stack as far as it goes, so the TTFTs of two stacks of
different speeds are taken at different loads; paced, they are compared at one.

Prints per stack requests/s, TTFT p50/p99 (first chunk with text) and the ingress process's CPU per
request (from /proc, all its threads: the workers, NATS and etcd are not counted), then the ratios
Flotilla/Dynamo (``--stacks flotilla``: Flotilla's side alone, no ratios, where Dynamo is not installed);
writes bench/results/stack_vs_dynamo.json. For context it also prints this load
generator's own CPU per request and the SSE chunks with text per answer: Flotilla's workers send
what the engine produced meanwhile as one frame, so its 32 tokens come in fewer chunks than Dynamo's
32, which costs the client (on the same 2 cores) less to read.
"""

import argparse
import asyncio
import contextlib
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvloop
from _common import RESULTS_DIR, cpu_seconds, percentile
from stacks import STACK_NAMES, Stack, dynamo_stack, flotilla_stack, stack_names
from trace_replay import StreamResult, http_request, read_stream

WORKERS = 2
MOCKER_SETTINGS = {"speedup_ratio": 1000}
PROMPT = "Write a short poem about the sea, the wind and the boats that sail between them."


@dataclass
class Measured:
    """One stack's completed requests, failures, wall seconds and ingress CPU seconds, summed over rounds."""

    requests: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    client_cpu: float = 0.0
    chunks: int = 0
    ttfts: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)

    def add(self, results: list[StreamResult]) -> None:
        """Count ``results``: the completed ones, their TTFTs and chunks; the failures by reason."""
        done = [r for r in results if r.error is None]
        self.requests += len(done)
        self.ttfts += [r.ttft for r in done]
        self.chunks += sum(len(r.token_times) for r in done)
        self.failures.update(r.error for r in results if r.error is not None)


async def _connection(
    port: int, request: bytes, tokens: int, next_due: Callable[[], float | None], into: list[StreamResult]
) -> None:
    """Send ``request`` on one keep-alive connection at each time ``next_due`` gives, until it gives
    None; a failure ends it.

    A request's TTFT counts from its due time: one that waited for a free connection (the stack is
    behind a paced load) waited for its first token too.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while (due := next_due()) is not None:
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            result = await read_stream(reader, writer, request)
            result.sent = min(result.sent, due)
            if result.error is None and result.completion_tokens != tokens:
                result.error = f"{result.completion_tokens} of {tokens} tokens"
            into.append(result)
            if result.error is not None:
                return
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        into.append(StreamResult(time.perf_counter(), error=type(exc).__name__))
    finally:
        writer.close()


async def closed_loop(port: int, request: bytes, tokens: int, seconds: float, concurrency: int) -> list[StreamResult]:
    """``concurrency`` connections, each sending its next request as soon as the last one ends."""
    until = time.perf_counter() + seconds

    def now_until_the_end() -> float | None:
        now = time.perf_counter()
        return now if now < until else None

    results: list[StreamResult] = []
    await asyncio.gather(*(_connection(port, request, tokens, now_until_the_end, results) for _ in range(concurrency)))
    return results


async def paced_loop(
    port: int, request: bytes, tokens: int, seconds: float, concurrency: int, rate: float
) -> list[StreamResult]:
    """Requests due at ``rate`` per second for ``seconds``, on at most ``concurrency`` connections."""
    start = time.perf_counter() + 0.05  # the connections open first
    schedule = deque(start + number / rate for number in range(max(1, round(rate * seconds))))

    def next_on_schedule() -> float | None:
        return schedule.popleft() if schedule else None

    results: list[StreamResult] = []
    await asyncio.gather(*(_connection(port, request, tokens, next_on_schedule, results) for _ in range(concurrency)))
    return results


def chat_request(stack: Stack, tokens: int) -> bytes:
    body: dict[str, Any] = {
        "model": stack.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return http_request(stack.port, "/v1/chat/completions", body, keep_alive=True)


def measure(stack: Stack, args: argparse.Namespace, into: Measured) -> None:
    """The closed loop: ``args.concurrency`` connections back to back (warm-up first)."""
    request = chat_request(stack, args.tokens)
    uvloop.run(closed_loop(stack.port, request, args.tokens, args.warmup, args.concurrency))
    cpu_before = sum(cpu_seconds(pid) for pid in stack.ingress_pids)
    client_before = time.process_time()
    started = time.perf_counter()
    results = uvloop.run(closed_loop(stack.port, request, args.tokens, args.seconds, args.concurrency))
    into.seconds += time.perf_counter() - started
    into.cpu += sum(cpu_seconds(pid) for pid in stack.ingress_pids) - cpu_before
    into.client_cpu += time.process_time() - client_before
    into.add(results)


def measure_paced(stack: Stack, args: argparse.Namespace, rate: float, into: Measured) -> None:
    """The open loop: requests due at ``rate`` per second (warm-up first), at most ``args.concurrency`` at once."""
    request = chat_request(stack, args.tokens)
    uvloop.run(paced_loop(stack.port, request, args.tokens, args.warmup, args.concurrency, rate))
    started = time.perf_counter()
    results = uvloop.run(paced_loop(stack.port, request, args.tokens, args.seconds, args.concurrency, rate))
    into.seconds += time.perf_counter() - started
    into.add(results)


@contextlib.contextmanager
def start(name: str) -> Iterator[Stack]:
    factory = flotilla_stack if name == "flotilla" else dynamo_stack
    with factory(workers=WORKERS, mocker_settings=MOCKER_SETTINGS, router_mode="round-robin") as stack:
        yield stack


def run_rounds(args: argparse.Namespace, measure_one: Callable[[Stack, Measured], None]) -> dict[str, Measured]:
    """``measure_one`` on a fresh stack of each kind per round, the order alternating between rounds."""
    runs = {name: Measured() for name in args.stacks}
    for round_number in range(args.rounds):
        order = args.stacks if round_number % 2 == 0 else args.stacks[::-1]
        for name in order:
            before = runs[name].requests
            try:
                with start(name) as stack:
                    measure_one(stack, runs[name])
            except RuntimeError as exc:  # a stack that did not come up: the logs in the message say why
                raise SystemExit(f"{name}: {exc}") from None
            print(f"round {round_number + 1}/{args.rounds} {name}: {runs[name].requests - before} requests", flush=True)
    for name, run in runs.items():
        if not run.requests:
            raise SystemExit(f"{name}: no request completed: {dict(run.failures)}")
    return runs


def summarize(run: Measured) -> dict[str, Any]:
    return {
        "requests": run.requests,
        "rps": run.requests / run.seconds,
        "ttft_p50_ms": percentile(run.ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(run.ttfts, 99) * 1000,
        "ingress_cpu_ms_per_request": run.cpu / run.requests * 1000,
        "client_cpu_ms_per_request": run.client_cpu / run.requests * 1000,
        "chunks_per_request": run.chunks / run.requests,
        "failures": dict(run.failures),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured time per stack and round")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured load before each measurement")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the order of the stacks alternates")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument(
        "--paced-share",
        type=float,
        default=0.8,
        help="then both stacks at this share of the slower one's closed-loop requests/s (0: skip)",
    )
    parser.add_argument(
        "--stacks", type=stack_names, default=list(STACK_NAMES), help="e.g. flotilla (default: flotilla,dynamo)"
    )
    args = parser.parse_args()
    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1 or args.concurrency < 1 or args.tokens < 1:
        parser.error("--seconds must be above 0, --warmup at least 0, the others at least 1")
    if not 0 <= args.paced_share <= 1:
        parser.error("--paced-share must be between 0 and 1")
    runs = run_rounds(args, lambda stack, into: measure(stack, args, into))

    print(
        f"\n{WORKERS} mockers at speed-up 1000 per stack, round-robin, {args.tokens}-token streamed chats, "
        f"concurrency {args.concurrency}, {args.rounds} round(s) of {args.seconds:g} s"
    )
    print(
        f"{'stack':10}{'requests/s':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'ingress CPU ms/req':>20}"
        f"{'client CPU ms/req':>19}{'chunks/req':>12}  failures"
    )
    summary = {name: summarize(run) for name, run in runs.items()}
    for name, row in summary.items():
        print(
            f"{name:10}{row['rps']:12.1f}{row['ttft_p50_ms']:13.2f}{row['ttft_p99_ms']:13.2f}"
            f"{row['ingress_cpu_ms_per_request']:20.3f}{row['client_cpu_ms_per_request']:19.3f}"
            f"{row['chunks_per_request']:12.1f}  {row['failures'] or ''}"
        )
    both = len(summary) == len(STACK_NAMES)
    ratios = {}
    if both:
        ratios = {
            key: summary["flotilla"][key] / summary["dynamo"][key]
            for key in ("rps", "ttft_p50_ms", "ttft_p99_ms", "ingress_cpu_ms_per_request")
        }
        print(
            f"Flotilla / Dynamo: requests/s {ratios['rps']:.2f}x (higher is better), "
            f"TTFT p50 {ratios['ttft_p50_ms']:.2f}x, p99 {ratios['ttft_p99_ms']:.2f}x, "
            f"ingress CPU per request {ratios['ingress_cpu_ms_per_request']:.2f}x (lower is better)"
        )
    result: dict[str, Any] = {"args": vars(args), "summary": summary, "ratios": ratios}
    if args.paced_share:
        # A closed loop runs each stack as fast as it goes, so a stack that answers more requests per
        # second also has more of them queued in its ingress at once: TTFTs taken at different loads.
        # The same requests/s for both (a share of the slower stack's most) compares them at one load.
        rate = args.paced_share * min(row["rps"] for row in summary.values())
        print(f"\nboth stacks paced at {rate:.1f} requests/s ({args.paced_share:g} of the slower one's closed loop)")
        paced = run_rounds(args, lambda stack, into: measure_paced(stack, args, rate, into))
        print(f"{'stack':10}{'requests/s':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'chunks/req':>12}  failures")
        paced_summary = {name: summarize(run) for name, run in paced.items()}
        for name, row in paced_summary.items():
            print(
                f"{name:10}{row['rps']:12.1f}{row['ttft_p50_ms']:13.2f}{row['ttft_p99_ms']:13.2f}"
                f"{row['chunks_per_request']:12.1f}  {row['failures'] or ''}"
            )
        paced_ratios = {}
        if both:
            paced_ratios = {
                key: paced_summary["flotilla"][key] / paced_summary["dynamo"][key]
                for key in ("ttft_p50_ms", "ttft_p99_ms")
            }
            print(
                f"Flotilla / Dynamo at {rate:.1f} requests/s: TTFT p50 {paced_ratios['ttft_p50_ms']:.2f}x, "
                f"p99 {paced_ratios['ttft_p99_ms']:.2f}x (lower is better)"
            )
        result["paced"] = {"rate": rate, "summary": paced_summary, "ratios": paced_ratios}
    out = RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / "stack_vs_dynamo.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
