"""Streamed chat completions against an OpenAI-compatible server, and the engine-vs-own-server comparison table.

Shared by the benchmarks that put Flotilla's engine beside the same engine served without Flotilla
(bench/mistralrs_vs_server.py, bench/vllm_vs_server.py): one load shape (a fixed list of requests, at most
``concurrency`` in flight), one summary per server and concurrency (output tokens/s over the wall time, TTFT
p50 to the first content delta), and the ratios against the issue's floors.
"""

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import percentile

#: The floors against the engine's own serving: Flotilla's throughput at least this fraction of it…
FLOOR_THROUGHPUT = 0.97
#: …and its TTFT p50 at most this multiple.
FLOOR_TTFT = 1.05

PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What are the benefits of regular exercise?",
)

#: One request's measurement: [TTFT in seconds (None: no content came), output tokens from usage].
Sample = list[Any]


@dataclass
class Result:
    server: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    ttft_p50_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def summarise(server: str, concurrency: int, wall_s: float, samples: Sequence[Sample]) -> Result:
    """Raises RuntimeError when a request wrote no content (a broken run must not pass for a fast one)."""
    ttfts = [ttft for ttft, _ in samples if ttft is not None]
    if len(ttfts) < len(samples):
        raise RuntimeError(f"{server}: {len(samples) - len(ttfts)} requests wrote no content")
    tokens = sum(int(count) for _, count in samples)
    return Result(server, concurrency, len(samples), tokens, wall_s, percentile(ttfts, 50))


def chat_payload(model: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy streamed chat request for one user prompt, asking for usage in the last chunk."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


async def stream_chat(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> Sample:
    """One greedy streamed chat completion; ``extra`` adds request fields (e.g. ``ignore_eos``)."""
    payload = chat_payload(model, prompt, max_tokens, extra)
    started, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or ():
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - started
    return [ttft, tokens]


async def http_load(
    server: str,
    base_url: str,
    model: str,
    max_tokens: int,
    concurrencies: Sequence[int],
    requests: int,
    extra: dict[str, Any] | None = None,
) -> list[Result]:
    """For each concurrency: ``requests`` chats over PROMPTS, at most that many in flight, after one warm-up."""
    results = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await stream_chat(client, model, "Say hello.", max_tokens, extra)  # warm-up, unmeasured
        for concurrency in concurrencies:
            gate = asyncio.Semaphore(concurrency)

            async def one(prompt: str, gate: asyncio.Semaphore = gate) -> Sample:
                async with gate:
                    return await stream_chat(client, model, prompt, max_tokens, extra)

            started = time.perf_counter()
            samples = await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(requests)))
            results.append(summarise(server, concurrency, time.perf_counter() - started, samples))
    return results


def report(title: str, baseline: list[Result], flotilla: list[Result], results_path: Path) -> None:
    """Print both servers' rows and the flotilla / baseline ratios against the floors; write them as JSON."""
    print(title)
    print(f"{'server':<10}{'conc':>5}{'reqs':>6}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'TTFT p50 s':>12}")
    for row in [*baseline, *flotilla]:
        print(
            f"{row.server:<10}{row.concurrency:>5}{row.requests:>6}{row.tokens:>8}{row.wall_s:>9.2f}"
            f"{row.tokens_per_s:>9.1f}{row.ttft_p50_s:>12.3f}"
        )
    name = baseline[0].server if baseline else "baseline"
    print(f"ratios flotilla / {name} (floors: throughput >= {FLOOR_THROUGHPUT}x, TTFT p50 <= {FLOOR_TTFT}x):")
    ratios = []
    for base, ours in zip(baseline, flotilla, strict=True):
        throughput = ours.tokens_per_s / base.tokens_per_s
        ttft = ours.ttft_p50_s / base.ttft_p50_s
        ratios.append({"concurrency": base.concurrency, "throughput": throughput, "ttft_p50": ttft})
        verdict = "met" if throughput >= FLOOR_THROUGHPUT and ttft <= FLOOR_TTFT else "NOT met"
        print(f"  concurrency {base.concurrency}: throughput {throughput:.3f}x, TTFT p50 {ttft:.3f}x ({verdict})")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(row) for row in [*baseline, *flotilla]]
    results_path.write_text(json.dumps({"results": rows, "ratios": ratios}, indent=2) + "\n")
