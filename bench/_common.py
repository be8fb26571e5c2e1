"""Helpers shared by the benchmarks: free ports, server subprocesses (nats-server too), process CPU time,
percentiles, where the raw numbers go."""

import contextlib
import gc
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from runtime.ports import free_port

#: Where the benchmarks write their raw numbers: bench/results/ (not committed), or the folder that
#: FLOTILLA_BENCH_RESULTS names: tests/bench/test_bench_smoke.py points it at a temporary one, so that its
#: smoke runs leave a real run's numbers alone.
RESULTS_DIR = Path(os.environ.get("FLOTILLA_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def percentile(values: Sequence[float], q: float) -> float:
    """Return the q-th percentile (0..100) of values, interpolating linearly (numpy's default).

    Raises ValueError on an empty sequence.
    """
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Keep the benchmark client's own garbage collector from pausing it while it measures.

    A client that keeps every request's token times grows a large heap, and a full collection of it
    stalls the client for 100-180 ms (measured in bench/trace_replay.py): every stream in flight then
    reads its next chunk that much later, and the stall counts as the server's latency. A run lasts
    seconds to minutes, so the heap may simply grow until the collector comes back on afterwards.
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


@dataclass
class ServerProcess:
    """A server subprocess in its own session (so its whole group can be stopped), logging to a file."""

    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it has not exited within timeout."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@contextlib.contextmanager
def running_server(
    command: Sequence[str],
    *,
    port: int,
    ready_path: str,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 120.0,
) -> Iterator[ServerProcess]:
    """Start command, wait until GET ready_path on 127.0.0.1:port answers 200, yield it, stop it on exit.

    Raises RuntimeError (with the tail of the server's log) if it exits or does not become ready.
    """
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            list(command),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            # Its own session: Ctrl-C reaches only us, and we stop the server (and any children) ourselves.
            start_new_session=True,
        )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_ready(server, ready_path, timeout)
        yield server
    finally:
        server.stop()


def _wait_ready(server: ServerProcess, ready_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(server.base_url + ready_path).status_code == 200:
                    return
            time.sleep(0.1)  # polling a process we do not control: there is no event to await
    raise RuntimeError(f"server not ready after {timeout:.0f}s:\n{server.log_tail()}")


@contextlib.contextmanager
def nats_server(directory: Path, *, jetstream: bool = False, timeout: float = 10.0) -> Iterator[int]:
    """nats-server on a free loopback port, logging to ``directory``/nats.log (and keeping JetStream's
    store there with ``jetstream``); yields its port once it accepts connections, stops it on exit.

    Raises RuntimeError (with the log's tail) when it exits or does not listen within ``timeout`` s.
    """
    port = free_port()
    log_path = directory / "nats.log"
    command = ["nats-server", "-a", "127.0.0.1", "-p", str(port), "-l", str(log_path)]
    if jetstream:
        command += ["-js", "-sd", str(directory / "jetstream")]
    try:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        raise RuntimeError("nats-server is not installed (`make system-deps` installs it)") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
                    raise RuntimeError(f"nats-server did not start on port {port}:\n{tail}") from None
                time.sleep(0.02)  # another process's start-up: no event to await
        yield port
    finally:
        process.terminate()
        process.wait()
