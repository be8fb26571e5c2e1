"""An `in=http` process stops cleanly on a signal, and several can share a port with --reuse-port."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.servers import free_port, start_server, stop_process


def test_ctrl_c_stops_a_server_with_exit_130(tmp_path: Path) -> None:
    server = start_server(["out=echo_full", "--model-name", "echo"], tmp_path / "server.log")
    assert stop_process(server.process, signal.SIGINT, timeout=20) == 130


def serve_on(port: int, log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start `flotilla run in=http out=echo_full ARGS` on ``port``; return once its banner is printed."""
    command = [sys.executable, "-m", "launcher.cli", "run", "in=http", "out=echo_full", "--model-name", "echo"]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen([*command, "--http-port", str(port), *args], stdout=log_file, stderr=log_file)
    deadline = time.monotonic() + 60
    while "Flotilla is serving" not in log_path.read_text():
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)  # another process's output: no event to await
    return process


def test_two_servers_share_a_port_with_reuse_port(tmp_path: Path) -> None:
    port = free_port()
    first = serve_on(port, tmp_path / "first.log", "--reuse-port")
    try:
        second = serve_on(port, tmp_path / "second.log", "--reuse-port")
        try:
            body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(timeout=10) as client:  # one connection per request: spread by the kernel
                statuses = [
                    client.post(
                        f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers={"Connection": "close"}
                    ).status_code
                    for _ in range(20)
                ]
            assert statuses == [200] * 20
        finally:
            assert stop_process(second, signal.SIGTERM, timeout=20) == 0
    finally:
        assert stop_process(first, signal.SIGTERM, timeout=20) == 0


def test_without_reuse_port_a_taken_port_is_a_configuration_error(tmp_path: Path) -> None:
    port = free_port()
    first = serve_on(port, tmp_path / "first.log")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "run", "in=http", "out=echo_full", "--http-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
        assert "--reuse-port" in result.stderr
    finally:
        stop_process(first, signal.SIGTERM, timeout=20)
