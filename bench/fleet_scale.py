"""Scale to ready: how long from a scale call (replicas 1 -> 4, mocker workers) until the fleet serves them.

Brings up the stack of tests/fleet/stack.py as real processes (Redis, etcd, NATS, the control plane under
uvicorn on SQLite, its Celery worker with beat, two `flotilla agent` nodes with 2 simulated 24 GiB GPUs
each, the gateway), deploys one pipeline of one mocker replica through the REST API, then per round:

1. scale to 1 and wait until the others are stopped (the starting point);
2. ``POST /scale/ {"replicas": 4}``, then poll the instances list every 20 ms: when each new instance
   first shows ``starting`` (dispatched and taken by its agent) and ``ready`` (worker up and registered);
3. from the moment all four are ready, send completions through the gateway until each of the four
   instances answered one (the ``x-flotilla-instance`` header; round-robin router).

    .venv/bin/python bench/fleet_scale.py [--rounds 5]

Prints per round and as median/max: call -> all starting (dispatch), starting -> ready (worker start
and registration, the slowest instance), call -> all ready in the API, call -> all answering through
the gateway. Floor (issue 8): all 4 ready <= 5 s after the call. Exit code 1 when the floor is missed.
"""

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from tests.fleet.stack import FleetStack  # noqa: E402
from tests.infra import EtcdServer, NatsServer, RedisServer  # noqa: E402
from tests.servers import smollm2_path  # noqa: E402

TARGET = 4
FLOOR_READY_S = 5.0
POLL_S = 0.02


def one_round(stack: FleetStack, pipeline: int) -> dict[str, float]:
    """One 1 -> 4 scale; seconds from the call to each milestone."""
    stack.scale(pipeline, 1)
    stack.wait_ready(pipeline, 1)
    old = {i["id"] for i in stack.instances(pipeline)}
    called = time.monotonic()
    stack.scale(pipeline, TARGET)
    starting: dict[int, float] = {}
    ready: dict[int, float] = {}
    while len(ready) < TARGET - 1:
        now = time.monotonic() - called
        for instance in stack.instances(pipeline):
            if instance["id"] in old:
                continue
            if instance["state"] in ("starting", "ready"):
                starting.setdefault(instance["id"], now)
            if instance["state"] == "ready":
                ready.setdefault(instance["id"], now)
            if instance["state"] == "failed":
                raise RuntimeError(f"instance {instance['id']} failed: {instance['reason']}\n{stack.logs()}")
        if now > 60:
            raise RuntimeError(f"not ready after 60 s: {stack.instances(pipeline)}\n{stack.logs()}")
        time.sleep(POLL_S)
    all_ready = time.monotonic() - called
    ids = {i["endpoint_instance_id"] for i in stack.instances(pipeline) if i["state"] == "ready"}
    seen: set[str] = set()
    while not ids <= seen:
        reply = stack.complete("bench", prompt=f"round {len(seen)} {time.monotonic()}")
        if reply.status_code == 200:
            seen.add(reply.headers["x-flotilla-instance"])
        if time.monotonic() - called > 60:
            raise RuntimeError(f"the gateway served only {seen} of {ids}")
    serving = time.monotonic() - called
    return {
        "dispatch (call -> all starting)": max(starting.values()),
        "worker start + registration (slowest)": max(ready[i] - starting[i] for i in ready),
        "call -> 4 ready in the API": all_ready,
        "call -> 4 answering via gateway": serving,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as temporary, contextlib.ExitStack() as cleanup:
        directory = Path(temporary)
        servers = (RedisServer(directory / "redis"), EtcdServer(directory / "etcd"), NatsServer(directory / "nats"))
        for server in servers:  # each stopped on the way out, even when a later start fails or is interrupted
            cleanup.callback(server.stop)
            server.start()
        stack = FleetStack(directory, *servers, smollm2_path())
        cleanup.callback(stack.stop)
        stack.start()
        pipeline = stack.deploy("bench", replicas=1)
        stack.wait_ready(pipeline, 1)
        results = []
        for number in range(1, rounds + 1):
            result = one_round(stack, pipeline)
            results.append(result)
            print(f"round {number}: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.items()), flush=True)
    print(f"\n{rounds} rounds, scale 1 -> {TARGET} mocker replicas over 2 nodes:")
    for key in results[0]:
        values = [r[key] for r in results]
        print(f"  {key:42s} median {statistics.median(values):5.2f} s   max {max(values):5.2f} s")
    worst = max(r["call -> 4 ready in the API"] for r in results)
    print(f"floor: 4 ready <= {FLOOR_READY_S} s after the call: {'met' if worst <= FLOOR_READY_S else 'MISSED'}")
    return 0 if worst <= FLOOR_READY_S else 1


if __name__ == "__main__":
    sys.exit(main())
