"""The benches' etcd and NATS (bench/network_path.py ``infrastructure``): a server whose port was taken between
``free_port()`` and its bind exits at start, and is started again on other ports rather than waited for."""

import importlib
import socket
from pathlib import Path

import httpx
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_a_server_whose_port_was_taken_is_started_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    network_path = importlib.import_module("network_path")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: etcd cannot bind it, and nothing answers there
        port = taken.getsockname()[1]
        real_free_port = network_path.free_port
        handed: list[int] = []

        def free_port() -> int:  # the first port asked for (etcd's) is the taken one
            handed.append(real_free_port() if handed else port)
            return handed[-1]

        monkeypatch.setattr(network_path, "free_port", free_port)
        with network_path.infrastructure(tmp_path) as env:
            assert env["ETCD_ENDPOINTS"] != f"http://127.0.0.1:{port}"
            health = httpx.get(env["ETCD_ENDPOINTS"] + "/health", timeout=10)
            assert health.status_code == 200, health.text
    assert len(handed) == 6  # two tries of three ports each
    assert (tmp_path / "etcd-1").is_dir()  # the second try's data, apart from the first's
