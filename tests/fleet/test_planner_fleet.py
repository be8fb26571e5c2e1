"""The planner end to end on a real fleet (tests/fleet/stack.py): `manage.py planner` as one more process
beside the control plane, its reconciler, two agents and the gateway, reading the workers' load reports on
NATS and the gateway's /metrics. Streamed completions through the gateway fill a slow mocker's small KV
cache past the pipeline's "up" threshold: the planner scales it up through the audited action, and back down
once the load stops; in advisory mode it only records; a planner killed mid-run is followed by another that
takes the lease over and goes on. The tests share one fleet and run in order."""

import contextlib
import datetime
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.agent.control_plane_server import json_of, wait_for
from tests.fleet.stack import FleetStack

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(120)]

MODEL = "planned"
#: Real time (speed-up 1) and a small KV cache: 64 blocks of 16 tokens. A request of ~40 prompt tokens and
#: 64 completion tokens holds up to 7 of them for the second or so it takes, so 8 streams at once fill
#: 60-80% of one worker's cache, and half that of two.
ENGINE_ARGS = {"speedup_ratio": 1, "num_gpu_blocks": 64, "block_size": 16}
STREAMS = 8
MAX_TOKENS = 64
#: Load mode (the model has no profile) on KV usage, with stability windows of seconds rather than minutes.
TARGETS: dict[str, Any] = {
    "default": {"min_replicas": 1, "max_replicas": 2},
    "load": {"kv_usage_up": 0.4, "kv_usage_down": 0.05},
    "stability": {"cooldown_s": 2, "reversal_s": 2, "down_window_s": 3},
}
INTERVAL_S = 1.0
#: The lease lasts three intervals (controlplane/planning/loop.py).
LEASE_S = 3 * INTERVAL_S


@pytest.fixture(scope="module")
def pipeline(fleet: FleetStack) -> int:
    """The planned pipeline, one worker ready and served, and a planner process running."""
    pipeline = fleet.deploy(MODEL, replicas=1, engine_args=ENGINE_ARGS)
    json_of(fleet.operator.patch(f"/api/v1/pipelines/{pipeline}/", json={"planner": TARGETS}))
    fleet.wait_ready(pipeline, 1)
    wait_for("the gateway to list the model", lambda: MODEL in fleet.served_models())
    fleet.start_planner(INTERVAL_S)
    return pipeline


@contextlib.contextmanager
def streaming_load(fleet: FleetStack, streams: int = STREAMS) -> Iterator[list[int]]:
    """``streams`` threads, each sending streamed completions one after another while the block runs:
    the status codes of those that ended (0 for one the connection failed, whose error is printed)."""
    assert fleet.gateway is not None
    url = fleet.gateway.api_url + "/completions"
    codes: list[int] = []
    done = threading.Event()

    def send(number: int) -> None:
        body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                prompt = f"stream {number} asks, at {time.monotonic()}, " + "about the fleet " * 10
                try:
                    with client.stream("POST", url, json=body | {"prompt": prompt}) as reply:
                        for _ in reply.iter_bytes():
                            pass
                except httpx.HTTPError as exc:
                    print(f"stream {number}: {exc!r}")  # shown when the test fails
                    codes.append(0)
                else:
                    codes.append(reply.status_code)

    senders = [threading.Thread(target=send, args=(number,)) for number in range(streams)]
    for sender in senders:
        sender.start()
    try:
        yield codes
    finally:
        done.set()
        for sender in senders:
            sender.join()


def decisions(fleet: FleetStack, pipeline: int, after: int = 0) -> list[dict[str, Any]]:
    """The pipeline's planner decisions with an id over ``after``, latest first."""
    found = json_of(fleet.operator.get(f"/api/v1/pipelines/{pipeline}/planner/decisions/", params={"page_size": 500}))
    return [d for d in found["results"] if d["id"] > after]


def latest_id(fleet: FleetStack, pipeline: int) -> int:
    return max((d["id"] for d in decisions(fleet, pipeline)), default=0)


def wait_for_decision(fleet: FleetStack, pipeline: int, after: int, what: str, **fields: Any) -> dict[str, Any]:
    """The first decision after ``after`` whose fields have the values given (the oldest such)."""

    def found() -> dict[str, Any]:
        matching = [d for d in decisions(fleet, pipeline, after) if all(d[k] == v for k, v in fields.items())]
        return matching[-1] if matching else {}

    return wait_for(
        what, found, 60, explain=lambda: f"decisions: {decisions(fleet, pipeline, after)[:5]}\n{fleet.logs()}"
    )


def scale_entries(fleet: FleetStack, pipeline: int) -> list[dict[str, Any]]:
    params = {"action": "pipeline.scale", "target_id": pipeline, "page_size": 100}
    return list(json_of(fleet.operator.get("/api/v1/audit/", params=params))["results"])


def test_load_through_the_gateway_scales_the_pipeline_up_and_its_end_scales_it_back_down(
    fleet: FleetStack, pipeline: int
) -> None:
    start = latest_id(fleet, pipeline)
    with streaming_load(fleet) as codes:
        up = wait_for_decision(fleet, pipeline, start, "a scale-up acted on", desired=2, acted=True)
        [first, second] = fleet.wait_ready(pipeline, 2)
        load_ended = time.monotonic()
    assert codes and set(codes) == {200}, codes
    assert up["current"] == 1 and up["mode"] == "load" and not up["advisory"], up
    assert "KV usage" in up["reason"] and "one replica more" in up["reason"], up
    [entry] = [e for e in scale_entries(fleet, pipeline) if e["after"].get("reason") == up["reason"]]
    assert entry["actor_name"] == "system:planner", entry
    assert {first["node"], second["node"]} == {"node-a", "node-b"}, "spread put the new one on the other node"

    down = wait_for_decision(fleet, pipeline, up["id"], "a scale-down acted on", desired=1, acted=True)
    [kept] = fleet.wait_ready(pipeline, 1)
    print(f"scaled down {time.monotonic() - load_ended:.1f} s after the load ended: {down['reason']}")  # with -s
    assert down["current"] == 2 and "under the scale-down thresholds" in down["reason"], down
    # Not before the scale-up's cooldown and the down window had passed (the rows' times are the planner's).
    between = _seconds_between(up["at"], down["at"])
    assert between >= TARGETS["stability"]["down_window_s"], (up, down)
    assert kept["id"] in {first["id"], second["id"]}
    reasons = [e["after"].get("reason") for e in scale_entries(fleet, pipeline)]
    assert down["reason"] in reasons


def test_advisory_mode_records_a_decision_and_changes_nothing(fleet: FleetStack, pipeline: int) -> None:
    advisory = TARGETS | {"advisory": True}
    json_of(fleet.operator.patch(f"/api/v1/pipelines/{pipeline}/", json={"planner": advisory}))
    [before] = fleet.wait_ready(pipeline, 1)
    audited = len(scale_entries(fleet, pipeline))
    start = latest_id(fleet, pipeline)
    try:
        with streaming_load(fleet) as codes:
            said = wait_for_decision(fleet, pipeline, start, "an advisory scale-up", desired=2, advisory=True)
    finally:
        json_of(fleet.operator.patch(f"/api/v1/pipelines/{pipeline}/", json={"planner": TARGETS}))
    assert codes and set(codes) == {200}, codes
    assert not said["acted"] and said["reason"].endswith("advisory: not acted on"), said
    assert fleet.pipeline(pipeline)["groups"][0]["replicas"] == 1
    assert [i["id"] for i in fleet.wait_ready(pipeline, 1)] == [before["id"]]
    assert len(scale_entries(fleet, pipeline)) == audited


def test_a_killed_planner_is_followed_by_another_that_takes_the_lease_over_and_goes_on(
    fleet: FleetStack, pipeline: int
) -> None:
    fleet.wait_ready(pipeline, 1)
    [first] = fleet.planners
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = time.monotonic()
    start = latest_id(fleet, pipeline)
    fleet.start_planner(INTERVAL_S)
    wait_for("the second planner to find the lease held", lambda: "holds the lease" in fleet.planner_log(2))
    took = wait_for("the second planner to take the lease", lambda: "took the lease over" in fleet.planner_log(2))
    assert took and time.monotonic() - killed_at <= LEASE_S + 3 * INTERVAL_S + 5, "within the lease and a turn"
    with streaming_load(fleet) as codes:
        up = wait_for_decision(fleet, pipeline, start, "the second planner's scale-up", desired=2, acted=True)
        fleet.wait_ready(pipeline, 2)
    assert codes and set(codes) == {200}, codes
    assert "one replica more" in up["reason"], up
    wait_for_decision(fleet, pipeline, up["id"], "the second planner's scale-down", desired=1, acted=True)
    fleet.wait_ready(pipeline, 1)


def _seconds_between(earlier: str, later: str) -> float:
    return (datetime.datetime.fromisoformat(later) - datetime.datetime.fromisoformat(earlier)).total_seconds()
