"""The etcd `flotilla up` starts compacts its history (launcher/stack/servers.py): a real etcd, run as up runs
it, with a history of a second instead of an hour."""

import base64
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from launcher.stack.servers import ETCD_HISTORY, etcd_server, find_binaries
from tests.servers import free_port, stop_process

pytestmark = pytest.mark.slow


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_ups_etcd_compacts_its_history(tmp_path: Path) -> None:
    assert ETCD_HISTORY == "1h"
    spec = etcd_server(find_binaries(("etcd",))["etcd"], free_port(), free_port(), tmp_path / "etcd", history="1s")
    log = (tmp_path / "etcd.log").open("wb")
    process = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=spec.url, timeout=5) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if client.get("/health").json().get("health") == "true":
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "etcd did not start"
                time.sleep(0.1)
            first = client.post("/v3/kv/put", json={"key": b64("k"), "value": b64("1")}).json()
            revision = int(first["header"]["revision"])
            for value in "234":
                client.post("/v3/kv/put", json={"key": b64("k"), "value": b64(value)})
            old = {"key": b64("k"), "revision": revision}
            assert "kvs" in client.post("/v3/kv/range", json=old).json()  # the old revision, still there
            deadline = time.monotonic() + 20
            while "compacted" not in client.post("/v3/kv/range", json=old).text:
                assert time.monotonic() < deadline, "etcd kept its history past its retention"
                time.sleep(0.5)
            latest = client.post("/v3/kv/range", json={"key": b64("k")}).json()["kvs"][0]
            assert base64.b64decode(latest["value"]) == b"4"  # compaction drops history, not the keys
    finally:
        stop_process(process, signal.SIGTERM)
        log.close()
