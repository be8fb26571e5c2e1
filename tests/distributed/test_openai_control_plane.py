"""What the control plane keeps of the OpenAI API, end to end with the official ``openai`` client against the
gateway: batches and files, and stored responses.

The Batch API: files uploaded and
batches created through the gateway (passed on to the control plane), run by the control plane's Celery
worker over two echo workers, results read back as OpenAI's output and error files, each key seeing only
its own, usage charged to the key; a cancelled batch keeps what finished; a batch survives its runner and
the control plane being killed mid-run, each request answered exactly once.

Stored responses: a Responses API answer is kept for its key (``store``, OpenAI's default), read back with
``responses.retrieve`` and ``input_items.list``, continued with ``previous_response_id`` (the workers are
echo_core: an answer echoes the whole prompt, so a continued turn shows the turns before it), deleted;
another key sees none of it.

One stack per module (etcd, NATS, Redis, the control plane and its Celery worker, a keyed gateway, two
workers): starting it costs seconds, and each test makes its own keys, files and batches.
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.agent.control_plane_server import REPOSITORY, ControlPlaneServer, json_of, wait_for
from tests.distributed.cluster import Cluster, wait_until
from tests.infra import EtcdServer, NatsServer, RedisServer
from tests.servers import Server, stop_process

MODEL = "echo"


@dataclass
class BatchStack:
    cluster: Cluster
    control_plane: ControlPlaneServer
    gateway: Server
    operator: httpx.Client
    directory: Path
    celery: subprocess.Popen[bytes] | None = None

    def start_celery(self) -> None:
        """The control plane's Celery worker with beat (the batch upkeep, the usage drain), as `flotilla up`
        runs it: both queues."""
        command = [sys.executable, "-m", "celery", "-A", "controlplane.celery_app", "worker", "-B"]
        command += ["-Q", "controlplane,controlplane.batches", "--pool", "solo", "--loglevel", "info"]
        command += ["-s", str(self.directory / "celerybeat-schedule")]
        with (self.directory / "celery.log").open("ab") as log_file:
            # A session of its own: its beat runs in a child process, which a kill of the worker alone would orphan.
            self.celery = subprocess.Popen(
                command,
                cwd=REPOSITORY,
                env=self.control_plane.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill_celery(self) -> None:
        """SIGKILL the worker and its beat child, as a crash of the machine's service would."""
        assert self.celery is not None
        os.killpg(self.celery.pid, signal.SIGKILL)
        self.celery.wait()
        self.celery = None

    def logs(self) -> str:
        celery = (self.directory / "celery.log").read_text(errors="replace")[-4000:]
        return f"--- celery ---\n{celery}\n--- control plane ---\n{self.control_plane.log()[-3000:]}"

    def new_key(self, name: str) -> tuple[int, str]:
        made = json_of(self.operator.post("/api/v1/api-keys/", json={"name": name}))
        key: str = made["key"]
        client = self.client(key)
        # Published through etcd: the gateway knows it within a moment.
        wait_for(f"the gateway to know key {name}", lambda: _known(client), explain=self.logs)
        return made["id"], key

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.api_url, api_key=key, max_retries=0, timeout=30)


def _known(client: openai.OpenAI) -> bool:
    try:
        client.models.list()
    except openai.AuthenticationError:
        return False
    return True


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchStack]:
    directory = tmp_path_factory.mktemp("batch-api")
    etcd, nats, redis = EtcdServer(directory / "etcd"), NatsServer(directory / "nats"), RedisServer(directory / "redis")
    for server in (etcd, nats, redis):
        server.start()
    cluster = Cluster(etcd, nats, directory)
    secret = directory / "api-keys.secret"
    secret.write_text("b" * 64 + "\n")
    secret.chmod(0o600)
    control_plane = ControlPlaneServer(directory / "controlplane", broker_url=redis.url)
    gateway = cluster.start_ingress(
        "--api-keys-secret-file", str(secret), "--quota-redis", redis.url, "--control-plane", control_plane.url
    )
    control_plane.env |= {
        "ETCD_ENDPOINTS": etcd.endpoint,
        "FLOTILLA_API_KEYS_SECRET_FILE": str(secret),
        "FLOTILLA_GATEWAY_URL": gateway.base_url,
        "FLOTILLA_BATCH_SLICE_S": "1",  # several slices per batch: the hand-over between them is tested too
        "FLOTILLA_BATCH_LEASE_S": "2",
        "FLOTILLA_BATCH_UPKEEP_S": "0.5",
        "FLOTILLA_BATCH_CONCURRENCY": "4",
        "FLOTILLA_USAGE_DRAIN_S": "1",
        "FLOTILLA_API_KEYS_SYNC_S": "1",
    }
    control_plane.start()
    # 20 ms a token: a batch of a few dozen requests runs for a few seconds, long enough to stop mid-way.
    cluster.start_workers(2, f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=20)
    wait_until(lambda: httpx.get(gateway.base_url + "/health").json()["models"] == [MODEL], 15, "no model")
    operator = control_plane.client(control_plane.person_token("operator", "operator"))
    stack = BatchStack(cluster, control_plane, gateway, operator, directory)
    stack.start_celery()
    yield stack
    if stack.celery is not None:
        stop_process(stack.celery, signal.SIGTERM, timeout=20)  # a warm shutdown stops its beat too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(stack.celery.pid, signal.SIGKILL)  # whatever of its group is left
    operator.close()
    control_plane.stop()
    cluster.stop()
    for server in (etcd, nats, redis):
        server.stop()


def jsonl(requests: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(request).encode() + b"\n" for request in requests)


def line(custom_id: str, prompt: str, model: str = MODEL) -> dict[str, Any]:
    """A completion request (echo_core answers its prompt back, 20 ms a token, at most 8)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def start_batch(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")


def wait_for_status(
    stack: BatchStack, client: openai.OpenAI, batch_id: str, *statuses: str, timeout_s: float = 60
) -> Any:
    def reached() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    return wait_for(f"{batch_id} to be {' or '.join(statuses)}", reached, timeout_s, explain=stack.logs)


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A result file's lines by custom_id; asserts no custom_id appears twice."""
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a request was answered twice"
    return by_id


def test_a_batch_sent_with_the_official_client_runs_over_the_fleet_and_is_charged_to_its_key(stack: BatchStack) -> None:
    key_id, key = stack.new_key("batch-owner")
    client = stack.client(key)
    lines = [line(f"req-{n}", f"question {n}") for n in range(12)]
    lines.append(line("wrong-model", "hello", model="no-such-model"))
    batch = start_batch(client, lines)
    assert batch.status == "validating" and batch.endpoint == "/v1/completions"

    done = wait_for_status(stack, client, batch.id, "completed")

    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (13, 12, 1)
    output, errors = results(client, done.output_file_id), results(client, done.error_file_id)
    assert sorted(output) == sorted(f"req-{n}" for n in range(12))
    for n in range(12):
        response = output[f"req-{n}"]["response"]
        assert response["status_code"] == 200
        assert response["body"]["choices"][0]["text"] == f"question {n}"
    assert errors["wrong-model"]["response"]["status_code"] == 404
    assert errors["wrong-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    # Listed, and the output file is the key's own (its purpose says what wrote it).
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    with pytest.raises(openai.ConflictError, match="only a batch in progress can be cancelled"):
        client.batches.cancel(batch.id)

    # The key's usage counts every request the batch sent (drained from Redis into the database each second).
    def usage_requests() -> int | None:
        rows = json_of(stack.operator.get("/api/v1/usage/", params={"key": key_id}))["results"]
        total = sum(row["requests"] for row in rows)
        return total if total == 13 else None

    wait_for("the batch's requests in the key's usage", usage_requests, explain=stack.logs)


def test_a_key_sees_only_its_own_files_and_batches(stack: BatchStack) -> None:
    _, mine = stack.new_key("owner-a")
    _, theirs = stack.new_key("owner-b")
    batch = start_batch(stack.client(mine), [line("one", "hi")])
    other = stack.client(theirs)

    with pytest.raises(openai.NotFoundError, match="No such Batch object"):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError, match="No such File object"):
        other.files.content(batch.input_file_id)
    with pytest.raises(openai.NotFoundError, match="No such File object"):
        other.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/completions", completion_window="24h")
    assert list(other.batches.list()) == [] and list(other.files.list()) == []
    wait_for_status(stack, stack.client(mine), batch.id, "completed")


def test_an_input_file_that_is_not_a_batch_fails_validation_naming_each_bad_line(stack: BatchStack) -> None:
    _, key = stack.new_key("validation")
    client = stack.client(key)
    good = line("a", "hi")
    wrong_url = {**line("b", "hi"), "url": "/v1/embeddings"}
    lines = jsonl([good, good, wrong_url]) + b"{not json\n"
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")

    failed = wait_for_status(stack, client, batch.id, "failed")

    assert failed.errors is not None
    assert [(e.code, e.line) for e in failed.errors.data] == [
        ("duplicate_custom_id", 2),
        ("mismatched_endpoint", 3),
        ("invalid_json_line", 4),
    ]
    # Requests the API refuses at once, each naming what is wrong.
    with pytest.raises(openai.BadRequestError, match="only 24h"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="cannot be batched"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune'"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.ConflictError, match="is the input file of"):
        client.files.delete(uploaded.id)
    with pytest.raises(openai.AuthenticationError):
        stack.client("sk-flt-" + "x" * 43).batches.list()


def test_a_cancelled_batch_keeps_what_finished_and_lists_the_rest_as_cancelled(stack: BatchStack) -> None:
    _, key = stack.new_key("canceller")
    client = stack.client(key)
    batch = start_batch(client, [line(f"c-{n}", "a long enough question " * 4) for n in range(200)])
    wait_for(
        "some results", lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4, explain=stack.logs
    )

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_for_status(stack, client, batch.id, "cancelled")

    output, errors = results(client, cancelled.output_file_id), results(client, cancelled.error_file_id)
    assert 4 <= len(output) < 200
    assert len(output) + len(errors) == 200 == cancelled.request_counts.total
    assert {line["error"]["code"] for line in errors.values()} == {"batch_cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


def test_a_batch_survives_its_runner_and_the_control_plane_killed_mid_run(stack: BatchStack) -> None:
    _, key = stack.new_key("survivor")
    client = stack.client(key)
    batch = start_batch(client, [line(f"s-{n}", "a long enough question " * 4) for n in range(120)])
    wait_for(
        "some results", lambda: client.batches.retrieve(batch.id).request_counts.completed >= 8, explain=stack.logs
    )
    assert client.batches.retrieve(batch.id).status == "in_progress"

    stack.kill_celery()
    stack.control_plane.kill()
    with pytest.raises(openai.InternalServerError, match="does not answer"):
        client.batches.retrieve(batch.id)
    stack.control_plane.start()
    stack.start_celery()

    done = wait_for_status(stack, client, batch.id, "completed", timeout_s=120)
    output = results(client, done.output_file_id)
    assert sorted(output) == sorted(f"s-{n}" for n in range(120))
    assert (done.request_counts.completed, done.request_counts.failed) == (120, 0)


def test_a_stored_response_is_retrieved_continued_and_deleted_by_its_key_only(stack: BatchStack) -> None:
    _, key = stack.new_key("chat-owner")
    _, other_key = stack.new_key("someone-else")
    client, other = stack.client(key), stack.client(other_key)

    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=200)
    assert first.store is True
    assert client.responses.retrieve(first.id).output_text == first.output_text
    [item] = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.content[0].text == "My name is Ada."  # type: ignore[union-attr]

    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=400
    )
    # echo_core answers the prompt it was given: the first turn, its answer, then the new question.
    prompt = second.output_text
    assert prompt.index("My name is Ada.") < prompt.index("What is my name?")
    assert second.previous_response_id == first.id

    with pytest.raises(openai.NotFoundError, match="not found"):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="Previous response with id"):
        other.responses.create(model=MODEL, input="hi", previous_response_id=first.id)
    for forged in (f"../batches?x={first.id}", f"{first.id}/../{first.id}", "a#b"):  # no other path is reached
        with pytest.raises(openai.NotFoundError, match="Previous response with id"):
            client.responses.create(model=MODEL, input="hi", previous_response_id=forged)

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=MODEL, input="forget me", store=False, max_output_tokens=8)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
