"""The Batch API's overhead (issue 41): the same short requests sent directly, and as one batch.

Starts the default stack as a person does (``flotilla up --no-pipeline``, in a fresh data folder on free
ports), deploys an echo pipeline (``--replicas`` CPU workers) and makes an API key, then, ``--rounds`` times
in turn:

* **direct**: ``--requests`` completions (``--max-tokens`` tokens each) sent to the gateway with the key,
  ``--concurrency`` at a time (httpx, one connection each);
* **batch**: the same requests as a JSONL file uploaded to ``/v1/files`` and run as one batch
  (``/v1/batches``) by the control plane's Celery worker, ``FLOTILLA_BATCH_CONCURRENCY`` = ``--concurrency``
  at a time, from the ``batches.create`` call until a poll (every 50 ms) sees it completed.

Prints both times per round and the median ratio batch / direct; with ``--requests`` 1000 or more, a
verdict against issue 41's floor (the batch within 1.1x the direct time), exit 1 when it is not met. The
raw numbers go to bench/results/batch_api.json.

    .venv/bin/python bench/batch_api.py [--requests 1000] [--concurrency 16] [--rounds 3] [--replicas 2]
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _common import RESULTS_DIR, free_port
from api_automation import echo_model_body, flotilla_up, pipeline_body, tail

FLOOR_RATIO = 1.1
FLOOR_MIN_REQUESTS = 1000
MODEL = "batch-echo"


def request_body(number: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"request {number}: tell me something short", "max_tokens": max_tokens}


async def direct(gateway: str, key: str, bodies: list[dict[str, Any]], concurrency: int) -> float:
    """Seconds to send ``bodies`` to the gateway, ``concurrency`` at a time. Raises on any failed answer."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gateway, headers=headers, limits=limits, timeout=60) as client:

        async def worker() -> None:
            while not queue.empty():
                (await client.post("/v1/completions", json=queue.get_nowait())).raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def as_batch(gateway: str, key: str, bodies: list[dict[str, Any]]) -> tuple[float, float]:
    """(seconds to upload the file, seconds from batches.create until it is seen completed)."""
    lines = [
        json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/completions", "body": body})
        for n, body in enumerate(bodies)
    ]
    content = ("\n".join(lines) + "\n").encode()
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        started = time.perf_counter()
        uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("batch.jsonl", content)})
        file_id = uploaded.raise_for_status().json()["id"]
        upload_s = time.perf_counter() - started
        started = time.perf_counter()
        batch = client.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        )
        batch_id = batch.raise_for_status().json()["id"]
        while True:
            state = client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
            if state["status"] == "completed":
                run_s = time.perf_counter() - started
                break
            if state["status"] in ("failed", "expired", "cancelled"):
                raise RuntimeError(f"the batch ended {state['status']}: {state}")
            time.sleep(0.05)  # polling, as a client does
        counts = state["request_counts"]
        if counts["completed"] != len(bodies):
            raise RuntimeError(f"the batch answered {counts} of {len(bodies)} requests")
    return upload_s, run_s


def setup(control_plane: str, token: str, replicas: int, gateway: str) -> str:
    """The echo pipeline (ready, served) and an API key; returns the key."""
    with httpx.Client(base_url=f"{control_plane}/api/v1/", headers={"Authorization": f"Bearer {token}"}) as api:
        model = api.post("models/", json=echo_model_body(MODEL, 64 << 20)).raise_for_status().json()
        api.post("pipelines/", json=pipeline_body(MODEL, model["name"], replicas)).raise_for_status()
        key: str = api.post("api-keys/", json={"name": "batch-bench"}).raise_for_status().json()["key"]
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        while time.monotonic() < deadline:
            try:
                answer = client.post("/v1/completions", json=request_body(0, 1))
                if answer.status_code == 200:
                    return key
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # the workers' start-up: nothing to await
    raise RuntimeError("the echo pipeline did not serve within 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="keep the stack's data folder here")
    args = parser.parse_args()

    os.environ["FLOTILLA_BATCH_CONCURRENCY"] = str(args.concurrency)  # the stack's Celery worker inherits it
    data_dir = args.keep or Path(os.environ.get("TMPDIR", "/tmp")) / f"flotilla-batch-bench-{os.getpid()}"
    gateway_port = free_port()
    gateway = f"http://127.0.0.1:{gateway_port}"
    bodies = [request_body(n, args.max_tokens) for n in range(args.requests)]
    rounds: list[dict[str, float]] = []
    with flotilla_up(data_dir, None, http_port=gateway_port) as stack:
        try:
            key = setup(stack.control_plane, stack.token(), args.replicas, gateway)
            asyncio.run(direct(gateway, key, bodies[: args.concurrency * 4], args.concurrency))  # warm-up
            for number in range(1, args.rounds + 1):
                direct_s = asyncio.run(direct(gateway, key, bodies, args.concurrency))
                upload_s, batch_s = as_batch(gateway, key, bodies)
                rounds.append({"direct_s": direct_s, "batch_s": batch_s, "upload_s": upload_s})
                print(
                    f"round {number}: direct {direct_s:.2f} s, batch {batch_s:.2f} s "
                    f"(upload {upload_s * 1000:.0f} ms), batch / direct {batch_s / direct_s:.2f}x",
                    flush=True,
                )
        except Exception:
            print(tail(stack.logs / "celery.log"), file=sys.stderr)
            raise
    ratio = statistics.median(r["batch_s"] / r["direct_s"] for r in rounds)
    shape = f"{args.requests} requests at concurrency {args.concurrency}"
    print(f"{shape}, batch / direct, median of the rounds: {ratio:.2f}x")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds, "ratio": ratio}
    (RESULTS_DIR / "batch_api.json").write_text(json.dumps(summary, indent=2))
    if args.requests >= FLOOR_MIN_REQUESTS:
        met = ratio <= FLOOR_RATIO
        verdict = "met" if met else "NOT met"
        print(f"floor (issue 41: a batch within {FLOOR_RATIO}x of the same requests sent directly): {verdict}")
        if not met:
            sys.exit(1)


if __name__ == "__main__":
    main()
