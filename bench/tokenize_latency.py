"""Tokenize latency (issue 41's floor: p99 <= 2 ms for 1k tokens).

Starts ``flotilla run in=http out=echo_core`` (the SmolLM2 tokenizer, no engine work on these routes) and,
one request at a time over one keep-alive connection (``http.client``, the lightest client in the standard
library), sends in turn, ``--requests`` times each:

* ``POST /v1/tokenize`` with a prompt of about ``--tokens`` tokens;
* ``POST /v1/detokenize`` of those tokens;
* ``GET /live``, the baseline: the same round trip through the same server with no work in it.

Prints p50 and p99 of each, and of tokenize and detokenize less the baseline's p50 (the work the route
itself adds); with ``--requests`` 1000 or more, a verdict against the floor, exit 1 when tokenize's p99 is
over it.

    .venv/bin/python bench/tokenize_latency.py [--requests 2000] [--tokens 1000]
"""

import argparse
import http.client
import json
import sys
import time
from pathlib import Path

from _common import RESULTS_DIR, free_port, percentile, running_server

ROOT = Path(__file__).resolve().parent.parent
FLOOR_P99_MS = 2.0
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def timed(connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None) -> tuple[float, bytes]:
    headers = {"content-type": "application/json"} if body is not None else {}
    started = time.perf_counter()
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    content = response.read()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"{method} {path} answered {response.status}: {content[:300]!r}")
    return elapsed * 1000, content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()

    port = free_port()
    log = RESULTS_DIR / "tokenize_latency.log"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "launcher.cli", "run", "in=http", "out=echo_core", "--http-port", str(port)]
    # Words of about one token each: "word0 word1 ..." is ~2 tokens a word; cut to the asked count below.
    prompt = " ".join(f"w{n % 97}" for n in range(args.tokens))
    with running_server(command, port=port, ready_path="/live", log_path=log, cwd=ROOT):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        _, content = timed(connection, "POST", "/v1/tokenize", json.dumps({"model": MODEL, "prompt": prompt}).encode())
        ids = json.loads(content)["tokens"][: args.tokens]
        text = json.loads(
            timed(connection, "POST", "/v1/detokenize", json.dumps({"model": MODEL, "tokens": ids}).encode())[1]
        )["prompt"]
        tokenize_body = json.dumps({"model": MODEL, "prompt": text}).encode()
        detokenize_body = json.dumps({"model": MODEL, "tokens": ids}).encode()
        count = len(json.loads(timed(connection, "POST", "/v1/tokenize", tokenize_body)[1])["tokens"])
        samples: dict[str, list[float]] = {"tokenize": [], "detokenize": [], "live": []}
        for _ in range(100):  # warm-up
            timed(connection, "POST", "/v1/tokenize", tokenize_body)
        for _ in range(args.requests):
            samples["tokenize"].append(timed(connection, "POST", "/v1/tokenize", tokenize_body)[0])
            samples["detokenize"].append(timed(connection, "POST", "/v1/detokenize", detokenize_body)[0])
            samples["live"].append(timed(connection, "GET", "/live", None)[0])
        connection.close()
    base = percentile(samples["live"], 50)
    summary: dict[str, object] = {"tokens": count, "requests": args.requests}
    print(f"{args.requests} requests each, one at a time, a prompt of {count} tokens:")
    for name, values in samples.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        summary[name] = {"p50_ms": p50, "p99_ms": p99}
        extra = (
            f" (less the baseline's p50: {p50 - base:.3f} / {p99 - base:.3f} ms)" if name != "live" else " (baseline)"
        )
        print(f"  {name:<10} p50 {p50:.3f} ms, p99 {p99:.3f} ms{extra}")
    (RESULTS_DIR / "tokenize_latency.json").write_text(json.dumps(summary, indent=2))
    if args.requests < 1000:
        return  # too few for a p99 to judge
    p99 = percentile(samples["tokenize"], 99)
    met = p99 <= FLOOR_P99_MS
    print(f"floor (issue 41: tokenize p99 <= {FLOOR_P99_MS} ms for 1k tokens): {'met' if met else 'NOT met'}")
    if not met:
        sys.exit(1)


if __name__ == "__main__":
    main()
