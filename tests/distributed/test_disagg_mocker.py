"""Disaggregated prefill/decode with mocker workers: the prompt computed on a prefill worker, its KV handed to a
decode worker that streams the answer, and every failure of the prefill side ending in a whole answer anyway.

Real processes on real etcd and NATS: an ingress, mocker workers at ``dyn://llm.prefill.generate`` with
``--disagg-role prefill`` and at ``dyn://llm.decode.generate`` with ``--disagg-role decode``. Who did what is
the ingress's own answer (the ``x-flotilla-instance`` and ``x-flotilla-prefill-instance`` headers) and its
``flotilla_router_disagg_decisions_total`` counter.
"""

import concurrent.futures
import json
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.distributed.cluster import Cluster, Worker, served_models, wait_until
from tests.distributed.test_router_health_metrics import scraped
from tests.servers import Server, free_port

pytestmark = pytest.mark.timeout(120)

MODEL = "llm"
BLOCK = 16
# Fast, with a transfer of 1 ms per prompt token (1 MB/token over 1 GB/s, simulated): visible, not slow.
SETTINGS = {"speedup_ratio": 100, "block_size": BLOCK, "num_gpu_blocks": 1024, "kv_transfer_bandwidth": 1.0,
            "kv_bytes_per_token": 1_000_000}  # fmt: skip


def start(
    cluster: Cluster,
    tmp_path: Path,
    role: str,
    count: int = 1,
    settings: dict[str, object] | None = None,
    extra: tuple[str, ...] = (),
) -> list[Worker]:
    return cluster.start_each([spec(tmp_path, role, settings, extra)] * count)


def spec(
    tmp_path: Path, role: str, settings: dict[str, object] | None = None, extra: tuple[str, ...] = ()
) -> tuple[str, tuple[str, ...]]:
    """The address and arguments of a mocker worker of ``role`` (``Cluster.start_each`` starts several at once)."""
    path = tmp_path / f"mocker-{role}.json"
    path.write_text(json.dumps({**SETTINGS, **(settings or {})}))
    address = f"dyn://{MODEL}.{role}.generate"
    return address, (
        "out=mocker",
        "--extra-engine-args",
        str(path),
        "--model-name",
        MODEL,
        "--disagg-role",
        role,
        *extra,
    )


def complete(ingress: Server, prompt: list[int], max_tokens: int = 5, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
    reply = httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == max_tokens
    return reply


def decisions(ingress: Server, path: str, reason: str) -> float:
    return scraped(ingress, "flotilla_router_disagg_decisions_total", model=MODEL, path=path, reason=reason)


def test_the_prompt_is_computed_on_the_prefill_worker_and_the_answer_on_the_decode_worker(
    cluster: Cluster, tmp_path: Path
) -> None:
    ingress = cluster.start_ingress()
    prefill_port, decode_port = free_port(), free_port()
    prefill, decode = cluster.start_each(
        [
            spec(tmp_path, "prefill", extra=("--metrics-port", str(prefill_port))),
            spec(tmp_path, "decode", extra=("--metrics-port", str(decode_port))),
        ]
    )
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    prompt = list(range(1000, 1000 + 4 * BLOCK + 3))

    first = complete(ingress, prompt)
    assert first.headers["x-flotilla-instance"] == decode.instance_id
    assert first.headers["x-flotilla-prefill-instance"] == prefill.instance_id
    again = complete(ingress, prompt)
    # What the prefill worker found in its cache the second time: the prompt's four full blocks.
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    assert decisions(ingress, "remote", "policy") == 2

    streamed = httpx.post(
        ingress.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt[:20], "max_tokens": 8, "stream": True},
        timeout=60,
    )
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "data: [DONE]"
    assert "error" not in streamed.text
    assert decisions(ingress, "remote", "policy") == 3
    # Each worker counts its part (the dashboard shows it): in its load reports, and on its /metrics.
    wait_until(lambda: worker_metric(prefill_port, "flotilla_worker_prefills_total") == 3, 10, "prefills uncounted")
    assert worker_metric(prefill_port, "flotilla_worker_prefill_seconds_total") > 0
    assert worker_metric(prefill_port, "flotilla_worker_kv_handoffs_total") == 0
    wait_until(lambda: worker_metric(decode_port, "flotilla_worker_kv_handoffs_total") == 3, 10, "handoffs uncounted")
    assert worker_metric(decode_port, "flotilla_worker_prefills_total") == 0


def worker_metric(port: int, name: str) -> float | None:
    """The value of rank 0's sample ``name`` on a worker's /metrics (None: absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("dp_rank") == "0":
                return sample.value
    return None


def test_without_a_prefill_worker_the_decode_worker_computes_the_prompt_and_one_that_comes_is_used(
    cluster: Cluster, tmp_path: Path
) -> None:
    ingress = cluster.start_ingress()
    [decode] = start(cluster, tmp_path, "decode")
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    alone = complete(ingress, list(range(100, 140)))
    assert alone.headers["x-flotilla-instance"] == decode.instance_id
    assert "x-flotilla-prefill-instance" not in alone.headers
    assert decisions(ingress, "local", "no_prefill") == 1

    [prefill] = start(cluster, tmp_path, "prefill")
    # A prefill worker alone serves nothing: the model stays the decode worker's, now prefilled remotely.
    wait_until(
        lambda: (
            complete(ingress, list(range(200, 240))).headers.get("x-flotilla-prefill-instance") == prefill.instance_id
        ),
        30,
        "the prefill worker was never used",
    )
    assert served_models(ingress) == [MODEL]


def test_a_prefill_worker_killed_or_frozen_costs_the_client_nothing(cluster: Cluster, tmp_path: Path) -> None:
    ingress = cluster.start_ingress()
    first, second, decode = cluster.start_each([spec(tmp_path, "prefill")] * 2 + [spec(tmp_path, "decode")])
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    complete(ingress, list(range(300, 340)))

    first.process.send_signal(signal.SIGSTOP)  # frozen: NATS still delivers to it, it answers nothing
    second.kill()  # gone: until its lease expires the ingress still lists it, and NATS says no responders
    try:
        for start_token in range(400, 700, 100):
            reply = complete(ingress, list(range(start_token, start_token + 40)))
            assert reply.headers["x-flotilla-instance"] == decode.instance_id
            assert "x-flotilla-prefill-instance" not in reply.headers
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert decisions(ingress, "local", "prefill_failed") + decisions(ingress, "local", "no_prefill") == 3
    assert decisions(ingress, "local", "prefill_failed") >= 1  # the frozen one was tried at least once


def test_the_isl_policy_keeps_a_prompt_mostly_cached_on_its_decode_worker_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    ingress = cluster.start_ingress("--router-mode", "kv", "--disagg-policy", "isl", "--disagg-isl-threshold", "64")
    prefill, _ = cluster.start_each([spec(tmp_path, "prefill"), spec(tmp_path, "decode")])
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    # Dynamo's isl_bounding: local only when what is left to compute is short *and* a small share of the
    # prompt, so a short prompt nobody holds still goes to the prefill worker. The model appears with the first
    # worker the ingress hears of: until it has heard of the prefill worker too, prompts stay local ("no_prefill"),
    # so each try is a prompt of its own (one computed locally would be cached where it decodes).
    tries = iter(range(20_000, 40_000, 40))  # apart from the conversation below
    replies: list[httpx.Response] = []

    def reached_the_prefill_worker() -> bool:
        start = next(tries)
        replies.append(complete(ingress, list(range(start, start + 40))))
        return "x-flotilla-prefill-instance" in replies[-1].headers

    wait_until(reached_the_prefill_worker, 15, "no prompt reached the prefill worker")
    fresh = replies[-1]
    assert fresh.headers["x-flotilla-prefill-instance"] == prefill.instance_id
    conversation = list(range(600, 600 + 12 * BLOCK))
    complete(ingress, conversation)  # the decode worker takes its KV, and publishes the blocks it holds
    # The next turn: 12 blocks the decode worker holds, 20 tokens to compute (< 64, and 10% of the prompt).
    wait_until(
        lambda: "x-flotilla-prefill-instance" not in complete(ingress, [*conversation, *range(900, 920)]).headers,
        15,
        "the next turn never stayed on the decode worker",
    )
    assert decisions(ingress, "local", "isl") >= 1 and decisions(ingress, "remote", "policy") >= 2


def test_the_load_policy_keeps_prompts_on_the_decode_worker_while_the_prefill_worker_is_busy(
    cluster: Cluster, tmp_path: Path
) -> None:
    # A prefill worker is busy past 1% of its step (82 of its 8192 tokens): one long prompt in flight does it.
    ingress = cluster.start_ingress("--disagg-policy", "load", "--disagg-prefill-busy", "0.01")
    port = free_port()
    slow = {"speedup_ratio": 0.1}  # a 3000-token prompt takes ~0.7 s
    prefill, _ = cluster.start_each(
        [spec(tmp_path, "prefill", settings=slow, extra=("--metrics-port", str(port))), spec(tmp_path, "decode")]
    )
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")

    def prefilling() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return "\nflotilla_worker_streams 1.0" in text

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, ingress, list(range(1000, 4000)), 2)
        wait_until(prefilling, 10, "the long prompt never reached the prefill worker")
        meanwhile = complete(ingress, list(range(5000, 5100)), 2)
        assert long.result().headers["x-flotilla-prefill-instance"] == prefill.instance_id
    assert "x-flotilla-prefill-instance" not in meanwhile.headers
    assert decisions(ingress, "local", "load") == 1
    assert complete(ingress, list(range(6000, 6100)), 2).headers["x-flotilla-prefill-instance"] == prefill.instance_id


def test_a_request_may_say_where_its_prompt_is_computed(cluster: Cluster, tmp_path: Path) -> None:
    ingress = cluster.start_ingress("--disagg-policy", "isl")
    prefill, _ = cluster.start_each([spec(tmp_path, "prefill"), spec(tmp_path, "decode")])
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    body = {"model": MODEL, "prompt": list(range(700, 760)), "max_tokens": 3}
    url = ingress.base_url + "/v1/completions"
    local = httpx.post(url, json=body, headers={"x-flotilla-disagg": "local"}, timeout=30)
    assert local.status_code == 200 and "x-flotilla-prefill-instance" not in local.headers
    remote = httpx.post(url, json=body, headers={"x-flotilla-disagg": "Remote"}, timeout=30)
    assert remote.headers["x-flotilla-prefill-instance"] == prefill.instance_id
    assert (decisions(ingress, "local", "header"), decisions(ingress, "remote", "header")) == (1, 1)
    wrong = httpx.post(url, json=body, headers={"x-flotilla-disagg": "sideways"}, timeout=30)
    assert wrong.status_code == 400
    assert wrong.json()["error"]["message"] == "x-flotilla-disagg must be local or remote, not 'sideways'"


def test_the_policy_a_pipelines_workers_register_is_the_one_the_ingress_uses(cluster: Cluster, tmp_path: Path) -> None:
    # As the node agent starts a pipeline's workers: its router settings as flags, registered with the model.
    # A decode gate at 1.0 lets every known fill through: the turn stays local once the worker's load is heard.
    pipeline = ("--router-mode", "kv", "--disagg-policy", "isl", "--disagg-isl-threshold", "64")
    pipeline += ("--disagg-decode-busy", "1")
    ingress = cluster.start_ingress()  # its own --disagg-policy: always
    cluster.start_each([spec(tmp_path, "prefill", extra=pipeline), spec(tmp_path, "decode", extra=pipeline)])
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    conversation = list(range(1000, 1000 + 12 * BLOCK))
    complete(ingress, conversation)
    wait_until(
        lambda: "x-flotilla-prefill-instance" not in complete(ingress, [*conversation, *range(900, 920)]).headers,
        15,
        "the pipeline's isl policy never kept a next turn on its decode worker",
    )
    assert decisions(ingress, "local", "isl") >= 1


def test_the_decode_gate_sends_a_prompt_the_policy_would_keep_local_away_from_a_full_decode_worker(
    cluster: Cluster, tmp_path: Path
) -> None:
    # isl keeps a next turn (20 tokens left to compute) on its decode worker, unless that worker's KV cache,
    # the turn's own 14 blocks of 128 counted, is more than 30% full. A long answer there (600 + 400 tokens, at
    # speed-up 1: seconds) holds 63 blocks more.
    ingress = cluster.start_ingress(
        "--router-mode", "kv", "--disagg-policy", "isl", "--disagg-isl-threshold", "64", "--disagg-decode-busy", "0.3"
    )
    decode_settings = {"speedup_ratio": 1, "num_gpu_blocks": 128}
    cluster.start_each([spec(tmp_path, "prefill"), spec(tmp_path, "decode", settings=decode_settings)])
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    conversation = list(range(1000, 1000 + 12 * BLOCK))
    complete(ingress, conversation)

    def next_turn_is_local() -> bool:
        return "x-flotilla-prefill-instance" not in complete(ingress, [*conversation, *range(900, 920)]).headers

    wait_until(next_turn_is_local, 15, "isl never kept a next turn on the idle decode worker")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, ingress, list(range(5000, 5600)), 400)
        wait_until(
            lambda: not next_turn_is_local(), 15, "the decode gate never sent a turn away from the full decode worker"
        )
        assert decisions(ingress, "remote", "decode_busy") >= 1
        long.result()
    wait_until(next_turn_is_local, 15, "the next turn never came back to the decode worker once it had room")
