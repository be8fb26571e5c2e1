"""`flotilla run in=http out=mocker --lora ... --lora-file ...`: adapters served by the HTTP process itself,
each a model of its own with its ``parent``, following the file without a restart."""

import json
import time
from pathlib import Path

import httpx

from tests.servers import Server, start_server


def models(server: Server) -> dict[str, dict[str, object]]:
    return {model["id"]: model for model in httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]}


def chat(server: Server, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def wait_until(condition: object, message: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, message
        time.sleep(0.1)  # another process's state: no event to await


def test_an_http_process_serves_its_adapters_and_follows_the_lora_file(tmp_path: Path) -> None:
    (tmp_path / "sql").mkdir()
    (tmp_path / "support").mkdir()
    lora_file = tmp_path / "adapters.json"
    settings = tmp_path / "mocker.json"
    settings.write_text('{"speedup_ratio": 0, "lora_load_time": 0}')
    server = start_server(
        ["out=mocker", "--model-name", "llm", "--extra-engine-args", str(settings),
         "--lora", f"sql={tmp_path / 'sql'}", "--lora-file", str(lora_file)],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        assert models(server)["sql"]["parent"] == "llm"
        assert chat(server, "sql").status_code == 200
        lora_file.write_text(json.dumps({"adapters": [{"name": "support", "path": str(tmp_path / "support")}]}))
        wait_until(lambda: "support" in models(server), "the file's adapter did not appear")
        assert chat(server, "support").status_code == 200
        lora_file.write_text('{"adapters": []}')
        wait_until(lambda: "support" not in models(server), "the adapter removed from the file stayed")
        assert chat(server, "support").status_code == 404
        assert set(models(server)) == {"llm", "sql"}
    finally:
        server.stop()
