"""Flotilla's vLLM engine (``flotilla run in=http out=vllm``) against vLLM's own OpenAI server.

Run from the repository root, in an environment that has vLLM (a GPU node with ``flotilla[vllm]``, or
vLLM's CPU build here):

    python bench/vllm_vs_server.py MODEL_DIR [--max-tokens 128] [--concurrency 1,8] [--requests 16] \
        [--engine-args '{"enforce_eager": true}'] [--ignore-eos]

MODEL_DIR is a Hugging Face folder (config, tokenizer, safetensors). Both servers load it with the same
engine arguments (``--engine-args``, a JSON object of ``AsyncEngineArgs`` fields, given to vLLM's server as
its flags and to Flotilla as ``--extra-engine-args``) and the same GPU memory share, one server at a time,
and answer the same chat prompts greedily (temperature 0), streamed, with at most ``concurrency`` requests
in flight. The baseline is ``python -m vllm.entrypoints.openai.api_server``: vLLM's HTTP server, its
templating and detokenization, its engine in a process of its own. Flotilla templates, tokenizes and
detokenizes itself and gives vLLM token ids in-process. ``--ignore-eos`` makes every answer
``--max-tokens`` long (for a model with random weights, whose first token may be EOS).

For each concurrency: the requests, their output tokens (from usage), wall time, output tokens/s over the
wall time, TTFT (first content delta) p50; then flotilla / vllm ratios against the floors (throughput >=
0.97x, TTFT p50 <= 1.05x). Results also go to bench/results/vllm_vs_server.json.
"""

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, free_port, running_server
from _openai_load import Result, http_load, report

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = RESULTS_DIR / "vllm_vs_server.json"
MODEL_NAME = "bench-model"
START_TIMEOUT_S = 900.0  # a first start compiles the model's graphs (torch.compile, CUDA graphs)


def server_flags(engine_args: dict[str, Any], *, false_flags: bool = True) -> list[str]:
    """``engine_args`` as an engine server's flags (``vllm serve``, SGLang's): ``--block-size 32``; a true
    boolean is a bare flag, a false one ``--no-…`` (or left out where ``false_flags`` is false: SGLang's
    flags have no ``--no-`` form); a dict or list is given as JSON."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            if false_flags:
                flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def measure(name: str, command: list[str], args: argparse.Namespace, log: Path, env: dict[str, str]) -> list[Result]:
    """Start ``command`` (an engine's own server, or ``flotilla run`` when ``name`` is "flotilla") on a free
    port, wait for it, and run the load at each of ``args.concurrency``."""
    port = free_port()
    command = [*command, "--http-port", str(port)] if name == "flotilla" else [*command, "--port", str(port)]
    extra = {"ignore_eos": True} if args.ignore_eos else None
    concurrencies = [int(value) for value in args.concurrency.split(",")]
    ready = "/live" if name == "flotilla" else "/health"
    with running_server(
        command, port=port, ready_path=ready, log_path=log, env=env, cwd=REPO_ROOT, timeout=START_TIMEOUT_S
    ) as server:
        return asyncio.run(
            http_load(name, server.base_url, MODEL_NAME, args.max_tokens, concurrencies, args.requests, extra)
        )


def parse_args(description: str, engine_args_help: str) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The command line shared by the engine-against-its-own-server benchmarks, and ``--engine-args`` read."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model", type=Path, help="a Hugging Face model folder (safetensors)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated concurrencies (1,8)")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency (16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="both servers' share (0.5)")
    parser.add_argument("--engine-args", default="{}", help=engine_args_help)
    parser.add_argument("--ignore-eos", action="store_true", help="every answer --max-tokens long")
    args = parser.parse_args()
    try:
        engine_args = json.loads(args.engine_args)
    except json.JSONDecodeError as exc:
        parser.error(f"--engine-args is not JSON: {exc}")
    if not isinstance(engine_args, dict):
        parser.error("--engine-args must be a JSON object")
    return args, engine_args


def main() -> None:
    args, engine_args = parse_args(__doc__.splitlines()[0], "JSON AsyncEngineArgs fields for both servers")
    model = str(args.model.resolve())
    share = str(args.gpu_memory_utilization)
    baseline_command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", MODEL_NAME, "--gpu-memory-utilization", share,
        *server_flags(engine_args),
    ]  # fmt: skip
    compare("vllm", baseline_command, args, engine_args, RESULTS_PATH)


def compare(
    engine: str,
    baseline_command: list[str],
    args: argparse.Namespace,
    engine_args: dict[str, Any],
    results_path: Path,
    baseline_env: dict[str, str] | None = None,
) -> None:
    """Measure ``baseline_command`` (the engine's own server) and then ``flotilla run in=http out=ENGINE`` with
    the same engine arguments and memory share, and print (and write to ``results_path``) their ratios."""
    flotilla_command = [
        sys.executable, "-m", "launcher.cli", "run", "in=http", f"out={engine}", str(args.model.resolve()),
        "--model-name", MODEL_NAME, "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--extra-engine-args", json.dumps(engine_args),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        baseline = measure(engine, baseline_command, args, Path(folder, f"{engine}.log"), baseline_env or {})
        quiet = {"FLOTILLA_LOG": "warning"}
        flotilla = measure("flotilla", flotilla_command, args, Path(folder, "flotilla.log"), quiet)
    title = (
        f"{args.model.name}, max_tokens {args.max_tokens}, {args.requests} requests per concurrency, greedy, "
        f"engine args {json.dumps(engine_args)}"
    )
    report(title, baseline, flotilla, results_path)


if __name__ == "__main__":
    main()
