"""`flotilla profile --upload`: the client side of PUT /api/v1/models/{id}/profile/, against a local stub that
holds it to the contract (method PUT, that path with its trailing slash, ``Authorization: Bearer TOKEN``, a JSON
body the planner reads) and answers what a test needs, and once against the real control plane.
"""

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from launcher.profile_upload import UploadFailed, UploadRefused, profile_url, upload_profile
from planner.profile import Profile
from tests.servers import free_port

WORKTREE = Path(__file__).resolve().parents[2]
DOCUMENT = {
    "version": 1,
    "gpus_per_replica": 1,
    "prefill": {"ttft_s": 0.5, "points": [{"isl": 512, "tokens_per_s": 40000}]},
    "decode": {"itl_s": 0.05, "points": [{"context_tokens": 1024, "tokens_per_s": 2400}]},
}


@dataclass
class Received:
    method: str
    path: str
    authorization: str | None
    content_type: str | None
    body: bytes


@dataclass
class Stub:
    """A control plane that records each request and answers ``status`` with ``answer``."""

    url: str
    received: list[Received] = field(default_factory=list)
    status: int = 200
    answer: bytes = b'{"ok": true}'


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    state = Stub(f"http://127.0.0.1:{server.server_address[1]}")

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            state.received.append(
                Received(
                    self.command,
                    self.path,
                    self.headers.get("Authorization"),
                    self.headers.get("Content-Type"),
                    self.rfile.read(length),
                )
            )
            self.send_response(state.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(state.answer)))
            self.end_headers()
            self.wfile.write(state.answer)

        do_PUT = do_POST = do_GET = _record

        def log_message(self, format: str, *args: object) -> None:
            pass

    server.RequestHandlerClass = Handler
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def test_the_profile_is_put_to_the_models_profile_path_with_the_token_as_bearer(stub: Stub) -> None:
    assert upload_profile(stub.url, "12", "flt_secret", DOCUMENT) == 200
    [request] = stub.received
    assert (request.method, request.path) == ("PUT", "/api/v1/models/12/profile/")
    assert request.authorization == "Bearer flt_secret"
    assert request.content_type == "application/json"
    assert json.loads(request.body) == DOCUMENT
    Profile.from_json(request.body)


def test_the_url_keeps_a_base_path_and_drops_a_trailing_slash() -> None:
    assert profile_url("http://cp:8000/", "3") == "http://cp:8000/api/v1/models/3/profile/"
    assert profile_url("https://cp.example/flotilla", "llama-8b") == (
        "https://cp.example/flotilla/api/v1/models/llama-8b/profile/"
    )


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (401, "the control plane refused the token (401)"),
        (403, "the control plane refused the token (403)"),
        (404, "the control plane has no model '12' (404"),
        (400, "the control plane refused the profile (400 at http://127.0.0.1:"),
    ],
)
def test_a_refusal_is_a_config_error_carrying_the_control_planes_reason(stub: Stub, status: int, said: str) -> None:
    stub.status, stub.answer = status, b'{"decode.points[0].tokens_per_s": ["must be a positive number"]}'
    with pytest.raises(UploadRefused) as refused:
        upload_profile(stub.url, "12", "flt_secret", DOCUMENT)
    assert said in str(refused.value)
    assert "must be a positive number" in str(refused.value)


def test_a_failing_control_plane_is_an_upload_failure_worth_retrying(stub: Stub) -> None:
    stub.status, stub.answer = 503, b""
    with pytest.raises(UploadFailed, match=r"failed to store the profile \(503 at .*\): \(no body\)"):
        upload_profile(stub.url, "12", "flt_secret", DOCUMENT)


def test_an_unreachable_control_plane_is_an_upload_failure() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UploadFailed, match=rf"could not upload the profile to {url}/api/v1/models/12/profile/"):
        upload_profile(url, "12", "flt_secret", DOCUMENT)


def flotilla_profile(stub: Stub, tmp_path: Path, token_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "launcher.cli", "profile", "out=mocker", "--ttft-target", "0.5",
            "--itl-target", "0.05", "--isl", "256", "--context", "256", "--max-concurrency", "2",
            "--upload", stub.url, "--model-id", "7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(WORKTREE), **token_env},
    )  # fmt: skip


def test_flotilla_profile_uploads_what_it_wrote_with_the_token_from_a_file(stub: Stub, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("flt_from_file\n")
    done = flotilla_profile(stub, tmp_path, {"FLOTILLA_TOKEN_FILE": str(token_file)})
    assert done.returncode == 0, done.stderr
    [request] = stub.received
    assert (request.method, request.path, request.authorization) == (
        "PUT",
        "/api/v1/models/7/profile/",
        "Bearer flt_from_file",
    )
    assert json.loads(request.body) == json.loads((tmp_path / "profile.json").read_text())
    assert f"uploaded to {stub.url} as model 7's profile (200)" in done.stdout


def test_a_refused_upload_exits_2_and_keeps_the_written_profile(stub: Stub, tmp_path: Path) -> None:
    stub.status, stub.answer = 403, b'{"detail": "You do not have permission to perform this action."}'
    done = flotilla_profile(stub, tmp_path, {"FLOTILLA_TOKEN": "flt_reader"})
    assert done.returncode == 2
    assert "flotilla profile: the control plane refused the token (403)" in done.stderr
    assert "Traceback" not in done.stderr
    Profile.from_json((tmp_path / "profile.json").read_text())


def test_flotilla_profile_uploads_to_a_real_control_plane_whose_model_then_has_it(
    tmp_path: Path, smollm2: Path
) -> None:
    # The control plane as a process (uvicorn, SQLite); no task is dispatched, so its broker is never reached.
    from tests.agent.control_plane_server import ControlPlaneServer, add_mocker_model

    control_plane = ControlPlaneServer(tmp_path / "controlplane", broker_url="redis://127.0.0.1:9/0")
    control_plane.start()
    try:
        token = control_plane.person_token("olga", "operator")
        operator = control_plane.client(token)
        model = add_mocker_model(operator, "smol", smollm2)
        done = subprocess.run(
            [
                sys.executable, "-m", "launcher.cli", "profile", "out=mocker", "--ttft-target", "0.5",
                "--itl-target", "0.05", "--isl", "256", "--context", "256", "--max-concurrency", "2",
                "--upload", control_plane.url, "--model-id", str(model["id"]),
            ],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(WORKTREE), "FLOTILLA_TOKEN": token},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        stored = operator.get(f"/api/v1/models/{model['id']}/profile/")
        assert stored.status_code == 200, stored.text
        assert stored.json() == json.loads((tmp_path / "profile.json").read_text())
    finally:
        control_plane.stop()
