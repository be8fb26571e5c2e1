"""The `flotilla` command line: helpful on misuse, never a traceback."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import build_run_parser, parse_run_options
from launcher.options import RunOptions


def flotilla(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FLOTILLA_TOKEN_ECHO_DELAY_MS": "0", **(env or {})},
    )


def options(*args: str) -> RunOptions:
    parser = build_run_parser()
    return parse_run_options(parser, parser.parse_intermixed_args(list(args)))


def test_inputs_engines_and_model_may_come_in_any_order() -> None:
    parsed = options("model.gguf", "--http-port", "9000", "out=echo_core", "in=http")
    assert (parsed.input, parsed.output, parsed.model, parsed.http_port) == ("http", "echo_core", "model.gguf", 9000)


def test_defaults_are_text_llamacpp_and_the_default_model() -> None:
    parsed = options()
    assert (parsed.input, parsed.output, parsed.model, parsed.http_host) == ("text", "llamacpp", None, "127.0.0.1")


def test_environment_variables_set_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_HTTP_PORT", "9100")
    monkeypatch.setenv("FLOTILLA_MODEL_NAME", "mine")
    parsed = options("in=http")
    assert (parsed.http_port, parsed.model_name) == (9100, "mine")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "in=socket"], "in='socket' is not an input"),
        (["run", "in=batch:"], "in='batch:' is not an input"),
        (["run", "out=gpt"], "out='gpt' is not an engine"),
        (["run", "a.gguf", "b.gguf"], "unexpected argument 'b.gguf'"),
        (["run", "--http-port", "70000"], "not a TCP port"),
        (["run", "--context-length", "0"], "must be at least 1"),
        (["run", "--temperature", "hot"], "not a number"),
        (["run", "--model-config", "/nonexistent"], "is not a folder"),
        (["serve"], "unknown command 'serve'"),
    ],
)
def test_misuse_exits_2_with_a_precise_message(args: list[str], message: str) -> None:
    result = flotilla(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_malformed_environment_variable_is_named() -> None:
    result = flotilla("run", env={"FLOTILLA_HTTP_PORT": "eighty"})
    assert result.returncode == 2
    assert "--http-port: 'eighty' is not an integer" in result.stderr


def test_an_engine_on_the_road_map_says_it_is_not_available_yet() -> None:
    result = flotilla("run", "out=vllm")
    assert result.returncode == 2
    assert "out=vllm is not available in this version yet" in result.stderr


def test_a_missing_model_file_is_a_clear_error(tmp_path: Path) -> None:
    result = flotilla("run", "out=echo_core", str(tmp_path / "missing.gguf"))
    assert result.returncode == 2
    assert "missing.gguf" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = flotilla("run", "in=http", "out=echo_full", "--http-port", str(port))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_a_piped_prompt_is_answered_once() -> None:
    result = flotilla("run", "out=echo_full", stdin="What is the capital of France?\n")
    assert result.returncode == 0
    assert result.stdout.strip() == "What is the capital of France?"


def test_help_teaches_inputs_engines_and_environment_variables() -> None:
    result = flotilla("run", "--help")
    assert result.returncode == 0
    for text in ("in=batch:FILE", "out=echo_core", "FLOTILLA_HTTP_PORT", "FLOTILLA_LOG", "examples:"):
        assert text in result.stdout
