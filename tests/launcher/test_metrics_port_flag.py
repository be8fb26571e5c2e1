"""``--metrics-port``: a worker's or an ingress process's own /metrics, and a clear error where there is none."""

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from launcher.cli import parse_run_options
from launcher.run_parser import build_run_parser
from tests.servers import free_port, start_server


def test_a_worker_takes_a_metrics_port_from_its_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_run_parser()
    args = ["in=dyn://llm.backend.generate", "out=echo_core", "--metrics-port", "9100"]
    assert parse_run_options(parser, parser.parse_intermixed_args(args)).metrics_port == 9100
    monkeypatch.setenv("FLOTILLA_METRICS_PORT", "9101")
    parser = build_run_parser()
    args = ["in=dyn://llm.backend.generate", "out=echo_core"]
    assert parse_run_options(parser, parser.parse_intermixed_args(args)).metrics_port == 9101


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["in=http", "out=dyn", "--http-port", "9100", "--metrics-port", "9100"], "is --http-port's"),
        (["in=text", "out=echo_full", "--metrics-port", "9100"], "in=text has no /metrics"),
        (["in=dyn://llm.backend.generate", "out=echo_core", "--metrics-port", "70000"], "not a TCP port"),
    ],
)
def test_a_metrics_port_outside_a_worker_or_out_of_range_is_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_run_parser()
    with pytest.raises(SystemExit) as exited:
        parse_run_options(parser, parser.parse_intermixed_args(args))
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_an_ingress_process_serves_its_own_metrics_on_its_metrics_port_too(tmp_path: Path) -> None:
    """Several ingress processes on one port (--reuse-port) answer /metrics there from whichever takes the scrape;
    each one's --metrics-port is its own, which a Prometheus reads one by one."""
    metrics_port = free_port()
    server = start_server(
        ["out=echo_full", "--model-name", "echo", "--metrics-port", str(metrics_port)], tmp_path / "ingress.log"
    )
    try:
        body = {"model": "echo", "messages": [{"role": "user", "content": "count me"}], "max_tokens": 4}
        assert httpx.post(server.api_url + "/chat/completions", json=body, timeout=30).status_code == 200
        own = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        shared = httpx.get(server.base_url + "/metrics", timeout=10)
    finally:
        server.stop()
    assert own.status_code == 200 and own.headers["content-type"].startswith("text/plain")
    labels = 'endpoint="chat_completions",model="echo",request_type="unary",status="success"'
    counted = f"flotilla_frontend_requests_total{{{labels}}} 1.0"
    assert counted in own.text and counted in shared.text
    with pytest.raises(httpx.TransportError):  # gone with the process
        httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)


def test_an_ingress_whose_metrics_port_is_taken_exits_2_saying_which_and_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [
            sys.executable, "-m", "launcher.cli", "run", "in=http", "out=echo_full", "--http-port", str(free_port()),
            "--metrics-port", str(port),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr and "--metrics-port" in done.stderr
    assert "Traceback" not in done.stderr
