"""The fleet end to end: pipelines deployed, scaled, broken and healed through the control plane's API, and
served by one gateway. Real processes throughout (tests/fleet/stack.py); the tests share one fleet and run
in order, each leaving it whole."""

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent.control_plane_server import add_mocker_model, json_of, wait_for
from tests.engines.image_requests import data_uri
from tests.engines.tiny_projector import IMAGE_TOKENS, write_projector
from tests.fleet.stack import MOCKER_ARGS, NODE_EVICT_S, NODE_TIMEOUT_S, NODES, FleetStack, running
from tests.servers import llama_cpp_available

# serial: eviction and heartbeat deadlines on a whole fleet, which a second core's load would stretch.
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(180)]
# The fault cases at the end run at the stack's short timings (tests/fleet/stack.py): what a production
# fleet does in 15 s and 5 minutes, this one does in 3 and 5 seconds.


def test_two_replicas_become_ready_and_the_gateway_serves_both(fleet: FleetStack) -> None:
    pipeline = fleet.deploy("smol", replicas=2)
    ready = fleet.wait_ready(pipeline, 2)
    assert {i["node"] for i in ready} == {"node-a", "node-b"}, "spread puts one replica on each node"
    wait_for("the gateway to list the model", lambda: "smol" in fleet.served_models())
    ids = {i["endpoint_instance_id"] for i in ready}
    assert fleet.served_by("smol", ids) == ids
    reply = fleet.complete("smol")
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def test_scaling_up_and_down_starts_and_stops_workers(fleet: FleetStack) -> None:
    [pipeline] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    fleet.scale(pipeline, 3)
    three = fleet.wait_ready(pipeline, 3)
    fleet.scale(pipeline, 1)
    [kept] = fleet.wait_ready(pipeline, 1)
    gone = [i for i in three if i["id"] != kept["id"]]
    states = {i["id"]: i["state"] for i in fleet.instances(pipeline)}
    assert all(states[i["id"]] == "stopped" for i in gone), states
    pids = [int(i["pid"]) for i in gone]
    wait_for(f"worker pids {pids} to end", lambda: not any(running(pid) for pid in pids))
    assert fleet.served_by("smol", {kept["endpoint_instance_id"]}, attempts=5) == {kept["endpoint_instance_id"]}


def test_a_killed_worker_is_reported_failed_and_restarted(fleet: FleetStack) -> None:
    [pipeline] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    [before] = fleet.wait_ready(pipeline, 1)
    os.kill(before["pid"], signal.SIGKILL)

    def restarted() -> dict[str, object]:
        instance = fleet.operator.get(f"/api/v1/instances/{before['id']}/").json()
        return instance if instance["restarts"] == 1 and instance["state"] == "ready" else {}

    after = wait_for("the instance to be restarted and ready", restarted, explain=fleet.logs)
    assert after["pid"] != before["pid"]
    # The agent reported it failed (the API went failed -> starting -> ready between polls), with why;
    # the reconciler restarted it.
    agent_log = fleet.agents[str(before["node"])].log()
    assert f"instance {before['id']}: failed (the worker killed by SIGKILL" in agent_log
    assert "'restarted': 1" in (fleet.directory / "reconciler.log").read_text()
    assert fleet.complete("smol").status_code == 200


def test_a_pipeline_too_big_for_any_node_is_pending_with_its_reason(fleet: FleetStack) -> None:
    pipeline = fleet.deploy("too-big", replicas=1, gpus=4)

    def pending() -> list[dict[str, object]]:
        found = fleet.instances(pipeline)
        return found if found and found[0]["state"] == "pending" and found[0]["reason"] else []

    [instance] = wait_for("the instance to be pending with a reason", pending, explain=fleet.logs)
    assert "4" in str(instance["reason"]) and "GPU" in str(instance["reason"]), instance


def test_each_pipeline_is_routed_by_its_own_router_settings(fleet: FleetStack) -> None:
    kv = fleet.deploy("smol-kv", replicas=2, router={"mode": "kv", "temperature": 0.0})
    rr = fleet.deploy("smol-rr", replicas=2, router={"mode": "round-robin"})
    kv_ids = {i["endpoint_instance_id"] for i in fleet.wait_ready(kv, 2)}
    rr_ids = {i["endpoint_instance_id"] for i in fleet.wait_ready(rr, 2)}
    wait_for("the gateway to list both", lambda: {"smol-kv", "smol-rr"} <= set(fleet.served_models()))
    # The same long prompt again and again: round-robin alternates, kv keeps it where its blocks are cached.
    prompt = "the same long prompt " * 40
    rr_seen = [fleet.complete("smol-rr", prompt).headers["x-flotilla-instance"] for _ in range(6)]
    assert set(rr_seen) == rr_ids, rr_seen
    fleet.complete("smol-kv", prompt)
    kv_seen = [fleet.complete("smol-kv", prompt).headers["x-flotilla-instance"] for _ in range(6)]
    assert len(set(kv_seen)) == 1 and set(kv_seen) <= kv_ids, kv_seen
    assert fleet.gateway is not None
    log = fleet.gateway.log()
    assert "model 'smol-kv' is now served (tokens, kv routing)" in log
    assert "model 'smol-rr' is now served (tokens, round-robin routing)" in log


def test_a_pipeline_of_prefill_and_decode_groups_computes_prompts_on_one_and_answers_on_the_other(
    fleet: FleetStack,
) -> None:
    model = add_mocker_model(fleet.operator, "smol-disagg-model", fleet.smollm2)
    group = {"replicas": 1, "gpus_per_replica": 1, "engine_args": MOCKER_ARGS}
    groups = [{"role": role, **group} for role in ("prefill", "decode")]
    body = {"name": "smol-disagg", "model": model["name"], "groups": groups}
    pipeline = json_of(fleet.operator.post("/api/v1/pipelines/", json=body))["id"]
    by_role = {i["role"]: i["endpoint_instance_id"] for i in fleet.wait_ready(pipeline, 2)}
    assert set(by_role) == {"prefill", "decode"}
    wait_for("the gateway to list it", lambda: "smol-disagg" in fleet.served_models())

    def prefilled_remotely() -> httpx.Response | None:
        reply = fleet.complete("smol-disagg", "a prompt for two workers " * 10)
        return reply if reply.headers.get("x-flotilla-prefill-instance") else None

    # The decode worker may register first: until the prefill worker's registration is in, prompts are local.
    reply = wait_for("a prompt computed on the prefill worker", prefilled_remotely, explain=fleet.logs)
    assert reply is not None and reply.status_code == 200, reply
    assert reply.headers["x-flotilla-prefill-instance"] == by_role["prefill"]
    assert reply.headers["x-flotilla-instance"] == by_role["decode"]


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (make install builds it)")
def test_a_llamacpp_model_registered_with_its_projector_answers_an_image_through_the_fleet(
    fleet: FleetStack, tmp_path: Path
) -> None:
    """The projector crosses from the catalog to the agent (as a path here; a file of the model's repo on the hub
    is fetched the same way) and the worker is started with it: the model takes images."""
    projector = write_projector(tmp_path / "mmproj-tiny.gguf")
    body = {
        "name": "smol-vision-model", "source_kind": "gguf", "source": str(fleet.smollm2), "engine": "llamacpp",
        "projector": str(projector),
    }  # fmt: skip
    model = json_of(fleet.operator.post("/api/v1/models/", json=body))
    # The control plane sees the files here: the projector counts in the memory estimate, as weights.
    sizes = fleet.smollm2.stat().st_size + projector.stat().st_size
    assert model["projector_bytes"] == projector.stat().st_size
    assert model["memory_bytes"] is not None and model["memory_bytes"] >= math.ceil(sizes * 1.2)
    group = {"replicas": 1, "gpus_per_replica": 0, "engine_args": {"threads": 1}}
    created = fleet.operator.post(
        "/api/v1/pipelines/", json={"name": "smol-vision", "model": model["name"], "groups": [group]}
    )
    pipeline = json_of(created)["id"]
    fleet.wait_ready(pipeline, 1, timeout_s=120)
    wait_for("the gateway to list it", lambda: "smol-vision" in fleet.served_models())
    content = [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": data_uri((0, 0, 255))}},
    ]
    chat = {"model": "smol-vision", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    assert fleet.gateway is not None
    reply = httpx.post(fleet.gateway.api_url + "/chat/completions", json=chat, timeout=60)
    assert reply.status_code == 200, reply.text
    text_only = {**chat, "messages": [{"role": "user", "content": "What is it?"}]}
    without = httpx.post(fleet.gateway.api_url + "/chat/completions", json=text_only, timeout=60)
    assert reply.json()["usage"]["prompt_tokens"] - without.json()["usage"]["prompt_tokens"] == IMAGE_TOKENS
    json_of(fleet.operator.post(f"/api/v1/pipelines/{pipeline}/stop/"))
    # The fleet is left whole for the next test: the replica stopped, not on its way.
    wait_for("the vision replica to stop", lambda: {i["state"] for i in fleet.instances(pipeline)} == {"stopped"})


def test_a_restarted_control_plane_loses_nothing_and_goes_on_reconciling(fleet: FleetStack) -> None:
    before = {i["id"]: (i["state"], i["node"], i["pid"]) for i in fleet.instances()}
    pipelines = fleet.operator.get("/api/v1/pipelines/").json()["results"]
    fleet.stop_control_plane()
    fleet.start_control_plane()
    assert {i["id"]: (i["state"], i["node"], i["pid"]) for i in fleet.instances()} == before
    assert fleet.operator.get("/api/v1/pipelines/").json()["results"] == pipelines
    [smol] = [p["id"] for p in pipelines if p["name"] == "smol"]
    fleet.scale(smol, 2)
    fleet.wait_ready(smol, 2)


@contextlib.contextmanager
def _traffic(fleet: FleetStack, model: str) -> Iterator[list[int]]:
    """Completions of ``model`` one after another, from a thread, while the block runs: their status codes.

    The body of each answer that is not a 200 is printed (shown when the test fails), since it names why."""
    codes: list[int] = []
    done = threading.Event()

    def send() -> None:
        while not done.is_set():
            reply = fleet.complete(model)
            codes.append(reply.status_code)
            if reply.status_code != 200:
                print(f"completion {len(codes)} answered {reply.status_code}: {reply.text}")

    sender = threading.Thread(target=send)
    sender.start()
    try:
        yield codes
    finally:
        done.set()
        sender.join()


def test_a_rolling_update_of_engine_args_under_traffic_fails_no_request(fleet: FleetStack) -> None:
    [smol] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    before = {i["id"] for i in fleet.wait_ready(smol, 2)}
    with _traffic(fleet, "smol") as codes:
        body = {"engine_args": {"speedup_ratio": 900}}
        updated = fleet.operator.post(f"/api/v1/pipelines/{smol}/update-group/", json=body).json()
        assert updated["groups"][0]["generation"] == 2, updated

        def rolled() -> list[dict[str, object]]:
            group = fleet.pipeline(smol)["groups"][0]
            return fleet.wait_ready(smol, 2) if group["outdated"] == 0 else []

        after = wait_for("the update to reach every replica", rolled, explain=fleet.logs)
    assert {i["id"] for i in after}.isdisjoint(before)  # each one replaced
    print(f"rolling update: {codes.count(200)} of {len(codes)} completions answered 200")  # shown with -s
    assert codes and set(codes) == {200}, codes


def test_a_drain_under_traffic_fails_no_request_and_each_replica_moves_once_its_replacement_is_ready(
    fleet: FleetStack,
) -> None:
    [smol] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    on_a = [i for i in fleet.wait_ready(smol, 2) if i["node"] == "node-a"]
    node_a = fleet.node("node-a")["id"]
    try:
        with _traffic(fleet, "smol") as codes:
            assert fleet.operator.post(f"/api/v1/nodes/{node_a}/drain/").status_code == 200

            def moved() -> list[dict[str, object]]:
                ready = fleet.wait_ready(smol, 2)
                return ready if all(i["node"] == "node-b" for i in ready) else []

            after = wait_for("the drained replicas to be replaced on node-b", moved, explain=fleet.logs)
    finally:
        fleet.operator.post(f"/api/v1/nodes/{node_a}/undrain/")
    print(f"drain: {codes.count(200)} of {len(codes)} completions answered 200")  # shown with -s
    assert codes and set(codes) == {200}, codes
    for old in on_a:
        stopped = fleet.operator.get(f"/api/v1/instances/{old['id']}/").json()
        assert stopped["state"] == "stopped" and stopped["reason"].startswith("replaced by "), stopped
    assert {i["id"] for i in after}.isdisjoint(old["id"] for old in on_a)  # the drained ones were replaced


def _workers(fleet: FleetStack) -> dict[int, tuple[str, str, int, int]]:
    """Each instance that should run, by id: its state, node, worker pid and restarts."""
    return {
        i["id"]: (i["state"], i["node"], i["pid"], i["restarts"])
        for i in fleet.instances()
        if i["state"] not in ("stopped", "failed")
    }


def _settled_workers(fleet: FleetStack) -> dict[int, tuple[str, str, int, int]]:
    """``_workers`` once no instance is on its way anywhere (a replacement placed or starting, a drained or
    replaced one stopping), so that what a fault changes is not mistaken for what was under way."""

    def in_transit(instance: dict[str, object]) -> bool:
        # A pending replacement, placed or not yet: the instance it replaces stops once it is ready.
        pending = instance["state"] == "pending" and (instance["node"] is not None or instance["replaces"])
        return pending or instance["state"] in ("downloading", "starting", "stopping")

    def settled() -> bool:
        instances = fleet.instances()
        # A replacement that is ready makes the reconciler stop the one it replaces at its next pass: until
        # then that one is still "ready", but on its way out.
        replaced = {i["replaces"] for i in instances if i["replaces"] is not None and i["state"] == "ready"}
        leaving = any(i["id"] in replaced and i["state"] not in ("stopped", "failed") for i in instances)
        return not leaving and not any(in_transit(i) for i in instances)

    wait_for("the fleet to settle", settled, explain=fleet.logs)
    return _workers(fleet)


def _serve_through(fleet: FleetStack, seconds: float, model: str = "smol") -> list[int]:
    """Completions one after another for ``seconds``: their status codes."""
    codes = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        codes.append(fleet.complete(model).status_code)
    print(f"{seconds:g} s of traffic: {codes.count(200)} of {len(codes)} completions answered 200")  # with -s
    return codes


def _silent_longer_than_eviction() -> float:
    return NODE_TIMEOUT_S + NODE_EVICT_S + 2


def test_a_control_plane_api_outage_restarts_no_worker_and_drops_no_request(fleet: FleetStack) -> None:
    """The API down (a slow migration on upgrade) while the reconciler runs on: every node falls silent."""
    before = _settled_workers(fleet)
    fleet.control_plane.stop()
    try:
        codes = _serve_through(fleet, _silent_longer_than_eviction())
    finally:
        fleet.control_plane.start()
    for node in NODES:
        wait_for(f"{node} to be online again", lambda node=node: fleet.node(node)["state"] == "online")  # type: ignore[misc]

    assert codes and set(codes) == {200}, codes
    assert _workers(fleet) == before
    assert "that run or could take instances are silent at once" in (fleet.directory / "reconciler.log").read_text()


def test_a_redis_outage_restarts_no_worker_and_the_reconciler_resumes_after_it(fleet: FleetStack) -> None:
    before = _settled_workers(fleet)
    fleet.redis.stop()
    try:
        codes = _serve_through(fleet, 6)
    finally:
        fleet.redis.start()
    assert codes and set(codes) == {200}, codes
    assert _workers(fleet) == before
    [smol] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    fleet.scale(smol, 3)  # the reconciler acts again once Celery has its broker back
    fleet.wait_ready(smol, 3)
    fleet.scale(smol, 2)
    fleet.wait_ready(smol, 2)


def test_a_frozen_redis_holds_no_api_call_takes_no_node_offline_and_a_scale_up_lands_once_it_thaws(
    fleet: FleetStack,
) -> None:
    """Redis SIGSTOPped (a fork stall, a host gone without closing its connections): every Redis command waits
    for an answer that does not come. Past the node timeout and the eviction time."""
    [smol] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    _settled_workers(fleet)
    before = {i["id"]: (i["node"], i["pid"], i["restarts"]) for i in fleet.wait_ready(smol, 2)}
    reconciler_log = fleet.directory / "reconciler.log"
    log_before = len(reconciler_log.read_bytes())
    redis = fleet.redis.process
    redis.send_signal(signal.SIGSTOP)
    try:
        # An operator's scale-up asks for a reconciler pass on Redis: it is answered at once all the same.
        answered = fleet.operator.post(f"/api/v1/pipelines/{smol}/scale/", json={"replicas": 3}, timeout=5)
        assert answered.status_code == 200, answered.text
        codes = _serve_through(fleet, _silent_longer_than_eviction())
        assert {fleet.node(name)["state"] for name in NODES} == {"online"}  # their heartbeats went on
    finally:
        redis.send_signal(signal.SIGCONT)
    try:
        assert codes and set(codes) == {200}, codes
        ready = fleet.wait_ready(smol, 3)  # the reconciler starts the third replica once its broker answers
        assert {i["id"]: (i["node"], i["pid"], i["restarts"]) for i in ready if i["id"] in before} == before
        after_freeze = reconciler_log.read_bytes()[log_before:].decode(errors="replace")
        assert "nodes offline" not in after_freeze and "database is locked" not in after_freeze, after_freeze
    finally:  # the fleet left as the next tests expect it
        fleet.scale(smol, 2)
        fleet.wait_ready(smol, 2)


def test_an_agent_cut_off_from_the_control_plane_loses_no_replica(fleet: FleetStack) -> None:
    """node-b's agent frozen (a partition: connections open, nothing answered) past the eviction time; its
    worker still signs that it is alive in etcd, so it is not dead and nothing is moved."""
    [smol] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    assert any(i["node"] == "node-b" for i in fleet.wait_ready(smol, 2))
    before = _settled_workers(fleet)
    agent = fleet.agents["node-b"].process
    agent.send_signal(signal.SIGSTOP)
    try:
        wait_for("node-b to go offline", lambda: fleet.node("node-b")["state"] == "offline", explain=fleet.logs)
        codes = _serve_through(fleet, NODE_EVICT_S + 2)
    finally:
        agent.send_signal(signal.SIGCONT)
    wait_for("node-b to be online again", lambda: fleet.node("node-b")["state"] == "online", explain=fleet.logs)

    assert codes and set(codes) == {200}, codes
    assert _workers(fleet) == before
    assert "but its workers sign that they are alive: not evicted" in (fleet.directory / "reconciler.log").read_text()


def test_a_lost_node_goes_offline_and_its_instances_move_to_the_other(fleet: FleetStack) -> None:
    [smol] = [p["id"] for p in fleet.operator.get("/api/v1/pipelines/").json()["results"] if p["name"] == "smol"]
    on_b = [i for i in fleet.wait_ready(smol, 2) if i["node"] == "node-b"]
    assert on_b, "spread put one of the two replicas on node-b"
    # The machine is gone: its agent and its workers, whose etcd leases then run out.
    fleet.agents["node-b"].process.kill()
    for instance in fleet.instances():
        if instance["node"] == "node-b" and instance["pid"]:
            with contextlib.suppress(ProcessLookupError):  # one that had ended already
                os.killpg(instance["pid"], signal.SIGKILL)
    wait_for("node-b to go offline", lambda: fleet.node("node-b")["state"] == "offline", explain=fleet.logs)

    def moved() -> dict[str, object]:
        lost = fleet.operator.get(f"/api/v1/instances/{on_b[0]['id']}/").json()
        return lost if lost["node"] == "node-a" and lost["state"] == "ready" else {}

    lost = wait_for("the lost replica to be ready on node-a", moved, explain=fleet.logs)
    assert lost["restarts"] == on_b[0]["restarts"] + 1
    ready = fleet.wait_ready(smol, 2)
    assert {i["node"] for i in ready} == {"node-a"}, ready
    served_by = {fleet.complete("smol").headers["x-flotilla-instance"] for _ in range(6)}
    assert served_by <= {i["endpoint_instance_id"] for i in ready}, (served_by, ready)
