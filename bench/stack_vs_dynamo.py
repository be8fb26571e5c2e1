"""Flotilla's whole stack against NVIDIA Dynamo 1.6.1's, side by side, on the same load.

Each stack is an ingress and 2 mocker workers at speed-up 1000 (the mockers wait ~nothing: the
serving path is what is measured), round-robin routing (bench/stacks.py: Flotilla on its own etcd
and NATS; Dynamo with file discovery, the TCP request plane and NATS events). Each is driven by a
closed loop of ``--concurrency`` keep-alive connections sending streamed chat completions of
``--tokens`` tokens (``ignore_eos``) back to back for ``--seconds``, after an unmeasured warm-up; the
stacks take turns, in alternating order, for ``--rounds`` rounds, each on a fresh stack.

    .venv/bin/python bench/stack_vs_dynamo.py [--seconds 8] [--rounds 2] [--concurrency 32] [--tokens 32]

Prints per stack requests/s, TTFT p50/p99 (first chunk with text) and the ingress process's CPU per
request (from /proc, all its threads: the workers, NATS and etcd are not counted), then the ratios
Flotilla/Dynamo; writes bench/results/stack_vs_dynamo.json. For context it also prints this load
generator's own CPU per request and the SSE chunks with text per answer: Flotilla's workers send
what the engine produced meanwhile as one frame, so its 32 tokens come in fewer chunks than Dynamo's
32, which costs the client (on the same 2 cores) less to read.
"""

import argparse
import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
from _common import cpu_seconds, percentile
from stacks import Stack, dynamo_stack, flotilla_stack
from trace_replay import StreamResult, http_request, read_stream

ROOT = Path(__file__).resolve().parent.parent
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


async def _connection(port: int, request: bytes, tokens: int, until: float, into: list[StreamResult]) -> None:
    """Send ``request`` back to back on one keep-alive connection until ``until``; a failure ends it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < until:
            result = await read_stream(reader, writer, request)
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
    until = time.perf_counter() + seconds
    results: list[StreamResult] = []
    await asyncio.gather(*(_connection(port, request, tokens, until, results) for _ in range(concurrency)))
    return results


def measure(stack: Stack, args: argparse.Namespace, into: Measured) -> None:
    body: dict[str, Any] = {
        "model": stack.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": args.tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = http_request(stack.port, "/v1/chat/completions", body, keep_alive=True)
    uvloop.run(closed_loop(stack.port, request, args.tokens, args.warmup, args.concurrency))
    cpu_before = sum(cpu_seconds(pid) for pid in stack.ingress_pids)
    client_before = time.process_time()
    started = time.perf_counter()
    results = uvloop.run(closed_loop(stack.port, request, args.tokens, args.seconds, args.concurrency))
    into.seconds += time.perf_counter() - started
    into.cpu += sum(cpu_seconds(pid) for pid in stack.ingress_pids) - cpu_before
    into.client_cpu += time.process_time() - client_before
    done = [r for r in results if r.error is None]
    into.requests += len(done)
    into.ttfts += [r.ttft for r in done]
    into.chunks += sum(len(r.token_times) for r in done)
    into.failures.update(r.error for r in results if r.error is not None)


@contextlib.contextmanager
def start(name: str) -> Iterator[Stack]:
    factory = flotilla_stack if name == "flotilla" else dynamo_stack
    with factory(workers=WORKERS, mocker_settings=MOCKER_SETTINGS, router_mode="round-robin") as stack:
        yield stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured time per stack and round")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured load before each measurement")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the order of the stacks alternates")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    args = parser.parse_args()
    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1 or args.concurrency < 1 or args.tokens < 1:
        parser.error("--seconds must be above 0, --warmup at least 0, the others at least 1")
    runs = {"flotilla": Measured(), "dynamo": Measured()}
    for round_number in range(args.rounds):
        order = ["flotilla", "dynamo"] if round_number % 2 == 0 else ["dynamo", "flotilla"]
        for name in order:
            before = runs[name].requests
            try:
                with start(name) as stack:
                    measure(stack, args, runs[name])
            except RuntimeError as exc:  # a stack that did not come up: the logs in the message say why
                raise SystemExit(f"{name}: {exc}") from None
            print(f"round {round_number + 1}/{args.rounds} {name}: {runs[name].requests - before} requests", flush=True)

    print(
        f"\n{WORKERS} mockers at speed-up 1000 per stack, round-robin, {args.tokens}-token streamed chats, "
        f"concurrency {args.concurrency}, {args.rounds} round(s) of {args.seconds:g} s"
    )
    print(
        f"{'stack':10}{'requests/s':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'ingress CPU ms/req':>20}"
        f"{'client CPU ms/req':>19}{'chunks/req':>12}  failures"
    )
    summary: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        if not run.requests:
            raise SystemExit(f"{name}: no request completed: {dict(run.failures)}")
        summary[name] = row = {
            "requests": run.requests,
            "rps": run.requests / run.seconds,
            "ttft_p50_ms": percentile(run.ttfts, 50) * 1000,
            "ttft_p99_ms": percentile(run.ttfts, 99) * 1000,
            "ingress_cpu_ms_per_request": run.cpu / run.requests * 1000,
            "client_cpu_ms_per_request": run.client_cpu / run.requests * 1000,
            "chunks_per_request": run.chunks / run.requests,
            "failures": dict(run.failures),
        }
        print(
            f"{name:10}{row['rps']:12.1f}{row['ttft_p50_ms']:13.2f}{row['ttft_p99_ms']:13.2f}"
            f"{row['ingress_cpu_ms_per_request']:20.3f}{row['client_cpu_ms_per_request']:19.3f}"
            f"{row['chunks_per_request']:12.1f}  {dict(run.failures) or ''}"
        )
    ratios = {
        key: summary["flotilla"][key] / summary["dynamo"][key]
        for key in ("rps", "ttft_p50_ms", "ttft_p99_ms", "ingress_cpu_ms_per_request")
    }
    print(
        f"Flotilla / Dynamo: requests/s {ratios['rps']:.2f}x (higher is better), "
        f"TTFT p50 {ratios['ttft_p50_ms']:.2f}x, p99 {ratios['ttft_p99_ms']:.2f}x, "
        f"ingress CPU per request {ratios['ingress_cpu_ms_per_request']:.2f}x (lower is better)"
    )
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    path = out / "stack_vs_dynamo.json"
    path.write_text(json.dumps({"args": vars(args), "summary": summary, "ratios": ratios}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
