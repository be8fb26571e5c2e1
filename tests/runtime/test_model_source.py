"""The model argument resolves to a local GGUF file or model folder, downloading from the hub if needed.

There is no internet here, so the hub is either a closed loopback port (unreachable) or a small real HTTP
server on loopback that answers the few hub endpoints huggingface_hub calls.
"""

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runtime.errors import ModelError, ModelUnreachable
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from runtime.models.source import HubModel, parse_hub_model, resolve_model

SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    """Repos by id (files by name), repos answering an error code, and the tokens clients sent."""

    url: str = ""
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)
    authorizations: list[str] = field(default_factory=list)


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str], *, head: bool = False) -> None:
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _answer(self, head: bool) -> None:
            hub.authorizations.append(self.headers.get("Authorization", ""))
            path = self.path.split("?")[0]
            api = path.startswith("/api/models/")
            parts = path.removeprefix("/api/models/").lstrip("/").split("/")
            repo = "/".join(parts[:2])
            if repo in hub.errors:
                status, code = hub.errors[repo]
                self._send(status, b'{"error": "no"}', {"X-Error-Code": code}, head=head)
                return
            files = hub.repos.get(repo)
            if files is None:
                self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head=head)
                return
            json_type = {"Content-Type": "application/json"}
            if api and "tree" in parts:  # /api/models/{repo}/tree/{revision}
                tree = [{"type": "file", "path": n, "size": len(b), "oid": n} for n, b in files.items()]
                self._send(200, json.dumps(tree).encode(), json_type, head=head)
            elif api:  # /api/models/{repo}[/revision/{revision}]
                info = {"id": repo, "sha": SHA, "siblings": [{"rfilename": name} for name in files]}
                self._send(200, json.dumps(info).encode(), json_type, head=head)
            elif parts[2:3] == ["resolve"] and "/".join(parts[4:]) in files:  # /{repo}/resolve/{rev}/{file}
                name = "/".join(parts[4:])
                headers = {"X-Repo-Commit": SHA, "ETag": f'"etag-{name}"'}
                self._send(200, files[name], headers, head=head)
            else:
                self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head=head)

        def do_GET(self) -> None:
            self._answer(head=False)

        def do_HEAD(self) -> None:
            self._answer(head=True)

    return Handler


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    hub = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield hub
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens here once the socket is closed


def test_no_argument_means_the_bundled_smollm2(smollm2: Path) -> None:
    assert resolve_model(None) == smollm2


def test_a_gguf_file_is_returned_as_is(smollm2: Path) -> None:
    assert resolve_model(str(smollm2)) == smollm2


def test_a_model_folder_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_a_folder_without_config_or_tokenizer_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"has neither config\.json nor tokenizer\.json"):
        resolve_model(str(tmp_path))


def test_a_file_that_is_not_gguf_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelError, match="is not a GGUF file"):
        resolve_model(str(tmp_path / "model.bin"))


@pytest.mark.parametrize("arg", ["xyz", "a/b/c.gguf", "/no/such/model.gguf", "org/", "org/na--me", "org/name:../x"])
def test_anything_else_is_a_model_error(arg: str) -> None:
    with pytest.raises(ModelError, match=r"is not a file, a folder, or a Hugging Face repo id"):
        resolve_model(arg)


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", HubModel("HuggingFaceTB/SmolLM2-135M-Instruct")),
        ("org/model-GGUF:model.Q8_0.gguf", HubModel("org/model-GGUF", "model.Q8_0.gguf")),
        ("org/model-GGUF:Q4_K_M", HubModel("org/model-GGUF", "Q4_K_M")),
        ("just-a-name", None),
        ("org/name/extra", None),
    ],
)
def test_repo_ids_are_parsed_with_an_optional_file_or_tag(arg: str, expected: HubModel | None) -> None:
    assert parse_hub_model(arg) == expected


def test_an_unreachable_hub_is_a_model_error_saying_what_to_do(
    monkeypatch: pytest.MonkeyPatch, closed_port: int, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for arg in ("HuggingFaceTB/SmolLM2-135M-Instruct", "org/model-GGUF:model.Q4_K_M.gguf"):
        with pytest.raises(ModelError, match=r"cannot reach the Hugging Face hub .*pass a local path"):
            resolve_model(arg, cache_dir=tmp_path, timeout=2)


def test_offline_mode_without_a_cached_copy_is_a_model_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match=r"HF_HUB_OFFLINE is set and 'org/model' is not in the Hugging Face cache"):
        resolve_model("org/model", cache_dir=tmp_path)


def test_offline_mode_uses_the_cached_snapshot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    repo = tmp_path / "models--org--model"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/model", cache_dir=tmp_path) == snapshot


def test_an_unknown_repo_is_a_model_error(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"'org/missing' does not exist or is private"):
        resolve_model("org/missing", cache_dir=tmp_path)


def test_a_gated_repo_is_a_model_error_that_asks_for_a_token(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.errors["org/gated"] = (403, "GatedRepo")
    with pytest.raises(ModelError, match=r"'org/gated' is gated: .*set HF_TOKEN"):
        resolve_model("org/gated", cache_dir=tmp_path)


def test_a_failing_hub_is_unreachable_so_that_a_supervisor_retries(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.errors["org/model"] = (503, "")
    with pytest.raises(ModelUnreachable, match=r"the Hugging Face hub failed on 'org/model' \(503\); try again later"):
        resolve_model("org/model", cache_dir=tmp_path)


def test_a_model_folder_is_downloaded_into_the_cache_and_loads(
    fake_hub: FakeHub, smollm2_card: ModelCard, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert smollm2_card.tokenizer_json is not None
    fake_hub.repos["org/tiny-chat"] = {
        "config.json": b'{"max_position_embeddings": 1024}',
        "tokenizer.json": smollm2_card.tokenizer_json.encode(),
        "tokenizer_config.json": b'{"chat_template": "{{ messages[0].content }}", "eos_token": "<|im_end|>"}',
        "model.safetensors": b"weights",
        "pytorch_model.bin": b"the same weights, skipped",
    }
    folder = resolve_model("org/tiny-chat", cache_dir=tmp_path)
    assert folder == tmp_path / "models--org--tiny-chat" / "snapshots" / SHA
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert "Bearer hf_secret" in fake_hub.authorizations
    card = load_model_card(folder)
    assert (card.name, card.context_length, card.eos_token_ids) == ("tiny-chat", 1024, [2])


def test_one_gguf_file_is_downloaded_by_name_or_quantization_tag(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.repos["org/model-GGUF"] = {
        "model.Q4_K_M.gguf": b"GGUF q4",
        "model.Q8_0.gguf": b"GGUF q8",
        "mmproj-model-Q8_0.gguf": b"GGUF projector",
    }
    by_name = resolve_model("org/model-GGUF:model.Q8_0.gguf", cache_dir=tmp_path)
    assert by_name.name == "model.Q8_0.gguf"
    assert by_name.read_bytes() == b"GGUF q8"
    assert resolve_model("org/model-GGUF:q8_0", cache_dir=tmp_path).read_bytes() == b"GGUF q8"
    assert resolve_model("org/model-GGUF", cache_dir=tmp_path).read_bytes() == b"GGUF q4"  # llama.cpp's default


def test_a_gguf_that_is_not_in_the_repo_is_a_model_error_listing_those_that_are(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    fake_hub.repos["org/model-GGUF"] = {"model.Q8_0.gguf": b"GGUF", "model.F16.gguf": b"GGUF"}
    with pytest.raises(ModelError, match=r"has no file 'model\.Q2_K\.gguf'; its GGUF files: model\.Q8_0\.gguf"):
        resolve_model("org/model-GGUF:model.Q2_K.gguf", cache_dir=tmp_path)
    with pytest.raises(ModelError, match=r"has 2 GGUF files and none match 'Q4_K_M'"):
        resolve_model("org/model-GGUF", cache_dir=tmp_path)
