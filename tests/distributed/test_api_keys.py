"""API keys on real ingress processes, called with the official ``openai`` client: records signed as the
control plane signs them (controlplane/apikeys/publication.py) and put in etcd; missing, wrong, expired,
revoked and out-of-scope keys are refused as OpenAI refuses them, a revocation reaches two ingress
processes within a second, malformed records in etcd are skipped while the others apply, and an ingress
without the secret says that /v1 is open."""

import contextlib
import hashlib
import hmac
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from runtime.fleet_contract.api_keys import KeyRecord, etcd_key, key_hash, new_key, sign
from tests.distributed.cluster import Cluster, etcd_put, wait_until
from tests.infra import RedisServer
from tests.servers import Server

SECRET = "k" * 64


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def publish(cluster: Cluster, key: str, *, secret: str = SECRET, **fields: object) -> None:
    """Put ``key``'s record in etcd, signed with the control plane's secret."""
    record = KeyRecord(**{"key_id": 1, "name": "chat-app", "owner": "alice", **fields})  # type: ignore[arg-type]
    hashed = key_hash(key)
    etcd_put(cluster.etcd, etcd_key(hashed), sign(record, hashed, secret.encode()).decode())


def client(server: Server, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=key or "unused", max_retries=0, timeout=30)


def ask(server: Server, key: str | None, model: str = "alpha") -> str:
    """The answer to "hi" with ``key``; None: with no Authorization header at all."""
    headers = {"Authorization": openai.Omit()} if key is None else None
    reply = client(server, key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], extra_headers=headers
    )
    return reply.choices[0].message.content or ""


def serving(server: Server) -> bool:
    return httpx.get(server.base_url + "/health", timeout=5).json()["models"] == ["alpha", "beta"]


def start(cluster: Cluster, secret_file: Path, count: int = 1) -> list[Server]:
    ingresses = [cluster.start_ingress("--api-keys-secret-file", str(secret_file)) for _ in range(count)]
    for name in ("alpha", "beta"):
        cluster.start_worker(f"dyn://{name}", "out=echo_core", "--model-name", name)
    for ingress in ingresses:
        wait_until(lambda: serving(ingress), 15, "the models did not appear")  # noqa: B023
    return ingresses


def test_only_a_published_key_opens_the_endpoint(cluster: Cluster, secret_file: Path) -> None:
    key = new_key()
    publish(cluster, key)
    (ingress,) = start(cluster, secret_file)

    assert ask(ingress, key).endswith("hi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(openai.AuthenticationError, match="You didn't provide an API key") as missing:
        ask(ingress, None)
    assert missing.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key provided") as wrong:
        ask(ingress, new_key())
    assert wrong.value.code == "invalid_api_key"
    # A record signed with another secret (a worker that can write etcd) opens nothing.
    forged = new_key()
    record = KeyRecord(key_id=9, name="forged", owner="mallory")
    etcd_put(cluster.etcd, etcd_key(key_hash(forged)), sign(record, key_hash(forged), b"f" * 64).decode())
    time.sleep(0.5)  # the watch event arrives in milliseconds; a forged key must not work even then
    with pytest.raises(openai.AuthenticationError):
        ask(ingress, forged)
    # Health, liveness and metrics stay open for probes and scrapers.
    for path in ("/health", "/live", "/metrics"):
        assert httpx.get(ingress.base_url + path, timeout=5).status_code == 200
    assert "API keys are off" not in ingress.log()


def test_a_key_sees_and_uses_only_its_models(cluster: Cluster, secret_file: Path) -> None:
    key = new_key()
    publish(cluster, key, models=["alpha"])
    (ingress,) = start(cluster, secret_file)

    assert [model.id for model in client(ingress, key).models.list()] == ["alpha"]
    assert ask(ingress, key, "alpha").endswith("hi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(openai.PermissionDeniedError, match="may not use the model 'beta'") as refused:
        ask(ingress, key, "beta")
    assert refused.value.code == "model_not_allowed"
    with pytest.raises(openai.PermissionDeniedError):
        client(ingress, key).models.retrieve("beta")
    # Nor does a wrong name tell it which other models are served.
    with pytest.raises(openai.PermissionDeniedError) as unknown:
        ask(ingress, key, "gamma")
    assert "beta" not in str(unknown.value)


def test_an_expired_key_is_refused_saying_when(cluster: Cluster, secret_file: Path) -> None:
    key = new_key()
    publish(cluster, key, expires_at=time.time() - 60)
    (ingress,) = start(cluster, secret_file)
    with pytest.raises(openai.AuthenticationError, match="expired at"):
        ask(ingress, key)


def test_a_revocation_reaches_two_ingress_processes_within_a_second(cluster: Cluster, secret_file: Path) -> None:
    key = new_key()
    publish(cluster, key, version=1)
    ingresses = start(cluster, secret_file, count=2)
    for ingress in ingresses:
        assert ask(ingress, key).endswith("hi<|im_end|>\n<|im_start|>assistant\n")

    publish(cluster, key, version=2, revoked=True)
    revoked_at = time.monotonic()
    for ingress in ingresses:
        wait_until(lambda: refused(ingress, key), 1.0, "a revoked key still worked after a second")  # noqa: B023
    assert time.monotonic() - revoked_at < 1.0


#: What a worker that can write etcd, or a bug, could leave under the keys' prefix. The first two sort
#: before any real key's hash: a watcher that died on them would re-list and die again before the rest.
MALFORMED: dict[str | bytes, str | bytes] = {
    etcd_key("0" * 64): "é" * 32 + "\n{}",  # a signature of non-ASCII bytes (once a TypeError)
    etcd_key("00"): "garbage",
    etcd_key(key_hash(new_key())): "a" * 64 + "\n" + "{" * 100_000,  # a signature that does not match
}


def test_malformed_records_are_skipped_and_counted_while_keys_and_revocations_apply(
    cluster: Cluster, secret_file: Path
) -> None:
    kept, revoked, late = new_key(), new_key(), new_key()
    publish(cluster, kept, key_id=1)
    publish(cluster, revoked, key_id=2, name="to-revoke", version=1)
    for key, value in MALFORMED.items():
        etcd_put(cluster.etcd, key, value)
    signed_bad = key_hash(new_key())  # signed with the secret, but out of bounds (an expiry past year 9999)
    body = '{"key_id": 3, "name": "x", "owner": "y", "expires_at": 1e300}'
    etcd_put(cluster.etcd, etcd_key(signed_bad), mac(signed_bad, body) + "\n" + body)
    (ingress,) = start(cluster, secret_file)  # it starts with them in etcd
    assert ask(ingress, kept) and ask(ingress, revoked)

    # Written while it watches: skipped too, and the revocation and the new key after them still apply.
    etcd_put(cluster.etcd, etcd_key("0" * 64), bytes(range(128, 192)) + b"\n{}")
    etcd_put(cluster.etcd, etcd_key("f" * 64).encode() + b"\xff", b"a key that is not UTF-8")  # skipped by the watch
    publish(cluster, revoked, key_id=2, name="to-revoke", version=2, revoked=True)
    publish(cluster, late, key_id=4, name="late")
    wait_until(lambda: refused(ingress, revoked), 10, "the revocation did not apply")
    assert ask(ingress, late) and ask(ingress, kept)

    skipped = skipped_records(ingress)
    assert skipped == {"unsigned": 2, "key": 1, "signature": 1, "malformed": 1}, skipped
    log = ingress.log()
    assert "API keys: skipped the record at" in log and "it is not UTF-8" in log and "Traceback" not in log
    assert ingress.process.poll() is None


def mac(hashed: str, body: str) -> str:
    """The control plane's signature of ``body`` for the key hash ``hashed``, as ``sign`` makes it."""
    return hmac.new(SECRET.encode(), f"{hashed}\n{body}".encode(), hashlib.sha256).hexdigest()


def skipped_records(server: Server) -> dict[str, float]:
    """The ingress's count of skipped key records by reason, from its /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    found = re.findall(r'^flotilla_frontend_api_key_records_skipped_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    return {reason: float(count) for reason, count in found}


def test_an_ingress_without_the_secret_warns_that_v1_is_open_and_says_how_to_require_keys(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: "alpha" in httpx.get(ingress.base_url + "/health", timeout=5).json()["models"], 15, "no model")
    assert ask(ingress, None)  # open indeed
    (line,) = [line for line in ingress.log().splitlines() if "API keys are off" in line]
    assert "WARNING" in line and "/v1/* is served to anyone" in line and "--api-keys-secret-file" in line


def refused(server: Server, key: str) -> bool:
    """Whether ``server`` refuses ``key`` as revoked (True) or still serves it (False)."""
    try:
        ask(server, key)
    except openai.AuthenticationError as exc:
        return "was revoked" in str(exc)
    return False


def test_a_requests_per_minute_limit_holds_across_two_ingress_processes(
    cluster: Cluster, secret_file: Path, redis_server: RedisServer
) -> None:
    key = new_key()
    publish(cluster, key, requests_per_minute=6)
    ingresses = [
        cluster.start_ingress("--api-keys-secret-file", str(secret_file), "--quota-redis", redis_server.url)
        for _ in range(2)
    ]
    for name in ("alpha", "beta"):
        cluster.start_worker(f"dyn://{name}", "out=echo_core", "--model-name", name)
    for ingress in ingresses:
        wait_until(lambda: serving(ingress), 15, "the models did not appear")  # noqa: B023
    # The limit slides over fixed minutes (what is left of the minute before counts in proportion), so six
    # requests on both sides of a minute's end would count as fewer than six: start early in a minute.
    into_minute = time.time() % 60
    if into_minute > 45:
        time.sleep(60.5 - into_minute)
    for turn in range(6):
        assert ask(ingresses[turn % 2], key)
        # The process that served it tells Redis at its next flush (0.1 s), the other reads it at its own.
        wait_until(lambda: requests_counted(redis_server) == turn + 1, 5, "the count did not reach Redis")  # noqa: B023
        time.sleep(0.3)
    for ingress in ingresses:
        with pytest.raises(openai.RateLimitError, match="6 requests per minute") as refused:
            ask(ingress, key)
        headers = refused.value.response.headers
        assert refused.value.code == "rate_limit_exceeded" and int(headers["retry-after"]) >= 1
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("6", "0")

    # Their usage is in Redis for the control plane (within a flush): 6 served, 2 refused, on model alpha.
    wait_until(lambda: usage_in(redis_server).get("1\talpha\trequests") == 8, 5, "the usage did not reach Redis")
    usage = usage_in(redis_server)
    assert usage["1\talpha\terrors"] == 2
    assert usage["1\talpha\tprompt_tokens"] > 0 and usage["1\talpha\tcompletion_tokens"] > 0


def requests_counted(server: RedisServer) -> int:
    """The fleet's request count of the current minute in ``server``, over every key's rate window."""
    client = redis.Redis.from_url(server.url)
    try:
        minute = int(time.time() // 60)
        return sum(int(client.get(name) or 0) for name in client.scan_iter(match=f"flotilla:rate:*:{minute}:r"))
    finally:
        client.close()


def usage_in(server: RedisServer) -> dict[str, int]:
    """Every count of the ingresses' usage hashes in ``server``."""
    client = redis.Redis.from_url(server.url)
    try:
        usage = {}
        for name in client.scan_iter(match="flotilla:usage:*"):
            usage.update({field.decode(): int(value) for field, value in client.hgetall(name).items()})
        return usage
    finally:
        client.close()


def test_a_key_past_its_concurrent_requests_is_refused_with_429_and_other_keys_are_not(
    cluster: Cluster, secret_file: Path
) -> None:
    capped, defaulted, other = new_key(), new_key(), new_key()
    publish(cluster, capped, key_id=1, name="capped", max_concurrent_requests=1)
    publish(cluster, defaulted, key_id=2, name="defaulted")  # takes the ingress's --max-concurrent-per-key
    publish(cluster, other, key_id=3, name="other")
    ingress = cluster.start_ingress("--api-keys-secret-file", str(secret_file), "--max-concurrent-per-key", "2")
    # echo_core sends the ~200-token templated prompt back at 50 ms a token: streams that last ~10 s.
    cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha", delay_ms=50)
    wait_until(lambda: "alpha" in httpx.get(ingress.base_url + "/health", timeout=5).json()["models"], 15, "no model")
    body = {"model": "alpha", "messages": [{"role": "user", "content": "count " * 200}], "stream": True}

    readers: list[Iterator[str]] = []  # kept: a reader dropped unread closes its response
    with contextlib.ExitStack() as streams:

        def open_stream(key: str) -> httpx.Response:
            response = streams.enter_context(
                httpx.stream("POST", ingress.api_url + "/chat/completions", json=body, headers=bearer(key), timeout=30)
            )
            assert response.status_code == 200
            readers.append(response.iter_lines())
            next(readers[-1])  # it is generating now
            return response

        first = open_stream(capped)
        with pytest.raises(openai.RateLimitError, match="'capped' has 1 requests in progress") as refused:
            ask(ingress, capped)
        assert refused.value.code == "concurrency_limit_exceeded"
        assert refused.value.response.headers["retry-after"] == "1"

        open_stream(defaulted)
        open_stream(defaulted)
        with pytest.raises(openai.RateLimitError, match="'defaulted' has 2 requests in progress"):
            ask(ingress, defaulted)
        assert ask(ingress, other)  # the keys at their caps take nothing from another key
        assert httpx.get(ingress.api_url + "/models", headers=bearer(capped), timeout=5).status_code == 200

        first.close()  # the client leaves: its place is given back once the ingress sees it go
        wait_until(lambda: served(ingress, capped), 10, "the capped key stayed refused after its request ended")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def served(server: Server, key: str) -> bool:
    """Whether ``server`` serves ``key`` now (False: refused at its cap of concurrent requests)."""
    try:
        return bool(ask(server, key))
    except openai.RateLimitError:
        return False


def test_the_signing_secret_is_rotated_under_traffic_without_a_refused_request(
    cluster: Cluster, secret_file: Path
) -> None:
    new_secret = "n" * 64
    key, revoked = new_key(), new_key()
    publish(cluster, key, version=1)
    publish(cluster, revoked, key_id=2, name="to-revoke", version=1)
    (ingress,) = start(cluster, secret_file)
    answers: list[str] = []
    stop = threading.Event()

    def traffic() -> None:  # a client calling all along; every answer is kept, refusals included
        while not stop.is_set():
            try:
                answers.append("ok" if ask(ingress, key) else "empty")
            except openai.APIError as exc:
                answers.append(repr(exc))

    def secrets_accepted(count: int) -> bool:
        return f"records signed with any of {count} accepted" in ingress.log()

    caller = threading.Thread(target=traffic)
    caller.start()
    try:
        # 1. Every ingress is given the new secret besides the old one: it reads its file again by itself.
        secret_file.write_text(SECRET + "\n" + new_secret + "\n")
        wait_until(lambda: secrets_accepted(2), 10, "the ingress did not read its secret file again")
        # 2. The control plane signs with the new one (first in its file); its sync re-signs every record.
        publish(cluster, key, version=1, secret=new_secret)
        publish(cluster, revoked, key_id=2, name="to-revoke", version=2, revoked=True, secret=new_secret)
        late = new_key()
        publish(cluster, late, key_id=3, name="late", secret=new_secret)
        wait_until(lambda: refused(ingress, revoked), 10, "a revocation signed with the new secret did not apply")
        assert ask(ingress, late)
        # 3. The old secret is removed: a record signed with it opens nothing from now on.
        secret_file.write_text(new_secret + "\n")
        wait_until(lambda: secrets_accepted(1), 10, "the ingress did not drop the old secret")
        calls = len(answers)
        wait_until(lambda: len(answers) > calls + 3, 10, "the client's calls stopped")  # served past the change
        forged = new_key()
        publish(cluster, forged, key_id=4, name="signed-with-the-old", secret=SECRET)
        wait_until(lambda: skipped_records(ingress).get("signature", 0) >= 1, 10, "the old-secret record applied")
        with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
            ask(ingress, forged)
    finally:
        stop.set()
        caller.join()
    assert len(answers) > 10 and set(answers) == {"ok"}, [answer for answer in answers if answer != "ok"][:3]
