"""The `flotilla` command line: helpful on misuse, never a traceback."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from frontend_gateway.openai_api.image_limits import ImageLimits
from launcher.cli import exit_code, parse_run_options
from launcher.options import RunOptions
from launcher.run_parser import build_run_parser
from runtime.errors import (
    BackgroundTaskFailed,
    ConfigError,
    DiscoveryUnavailable,
    FlotillaError,
    ModelError,
    ModelUnreachable,
    RequestPlaneUnavailable,
    TemplateError,
)
from runtime.fleet_contract.router_settings import PipelineRouter
from tests.servers import free_port


def flotilla(
    *args: str, stdin: str = "", env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "FLOTILLA_TOKEN_ECHO_DELAY_MS": "0", **(env or {})},
    )


def options(*args: str) -> RunOptions:
    parser = build_run_parser()
    return parse_run_options(parser, parser.parse_intermixed_args(list(args)))


def test_inputs_engines_and_model_may_come_in_any_order() -> None:
    parsed = options("model.gguf", "--http-port", "9000", "out=echo_core", "in=http")
    assert (parsed.input, parsed.output, parsed.model, parsed.http_port) == ("http", "echo_core", "model.gguf", 9000)


def test_router_flags_given_to_a_worker_are_registered_and_absent_ones_leave_it_to_the_gateway() -> None:
    plain = options("in=dyn://llm", "out=echo_full")
    assert plain.worker_router is None
    assert (plain.router_mode, plain.kv_overlap_score_weight, plain.use_kv_events) == ("round-robin", 1.0, True)
    given = options("in=dyn://llm", "out=echo_full", "--router-mode", "kv", "--use-kv-events", "false")
    assert given.worker_router == PipelineRouter(mode="kv", use_kv_events=False)


def test_router_replica_sync_is_on_unless_turned_off_by_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert options("in=http", "out=dyn", "--router-mode", "kv").router_replica_sync is True
    assert options("in=http", "out=dyn", "--router-replica-sync", "false").router_replica_sync is False
    monkeypatch.setenv("FLOTILLA_ROUTER_REPLICA_SYNC", "false")
    assert options("in=http", "out=dyn").router_replica_sync is False


def test_a_worker_given_only_the_queued_prefill_weight_registers_router_settings_with_it() -> None:
    given = options("in=dyn://llm", "out=echo_full", "--kv-queued-prefill-weight", "0.25")
    assert given.worker_router == PipelineRouter(queued_prefill_weight=0.25)


def test_the_ingress_takes_the_control_planes_url_from_its_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert options("in=http", "out=dyn", "--control-plane", "http://cp:8000/").control_plane_url == "http://cp:8000"
    monkeypatch.setenv("FLOTILLA_CONTROL_PLANE", "https://cp.example")
    assert options("in=http", "out=dyn").control_plane_url == "https://cp.example"


def test_defaults_are_text_llamacpp_and_the_default_model() -> None:
    parsed = options()
    assert (parsed.input, parsed.output, parsed.model, parsed.http_host) == ("text", "llamacpp", None, "127.0.0.1")


def test_environment_variables_set_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_HTTP_PORT", "9100")
    monkeypatch.setenv("FLOTILLA_MODEL_NAME", "mine")
    parsed = options("in=http")
    assert (parsed.http_port, parsed.model_name) == (9100, "mine")


def test_parsers_are_named_by_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_TOOL_CALL_PARSER", "hermes")
    parsed = options("--reasoning-parser", "deepseek_r1")
    assert (parsed.reasoning_parser, parsed.tool_call_parser) == ("deepseek_r1", "hermes")


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
        (["run", "--reasoning-parser", "deepseek"], "invalid choice: 'deepseek'"),
        (["run", "--tool-call-parser", "json"], "invalid choice: 'json'"),
        (["run", "--mmproj", "/nonexistent.gguf"], "/nonexistent.gguf is not a file"),
        (["run", "in=http", "--allowed-origins", "127.0.0.1:8000"], "'127.0.0.1:8000' is not an origin"),
        (["run", "--allowed-origins", "http://127.0.0.1:8000"], "in=text serves none"),
        (["run", "out=mocker", "--mmproj", __file__], "out=mocker does not take one"),
        (["serve"], "unknown command 'serve'"),
        (["run", "in=http", "out=dyn", "--control-plane", "cp:8000"], "'cp:8000' is not an http(s) URL with a host"),
        (
            ["run", "in=http", "out=echo_full", "--control-plane", "http://cp:8000"],
            "is for the ingress (in=http out=dyn)",
        ),
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
    assert result.stderr == "flotilla: FLOTILLA_HTTP_PORT: 'eighty' is not an integer\n"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("FLOTILLA_ROUTER_MODE", "bogus", "FLOTILLA_ROUTER_MODE='bogus' is not one of: round-robin, random"),
        ("FLOTILLA_MIGRATION_LIMIT", "-1", "FLOTILLA_MIGRATION_LIMIT: -1 must be at least 0"),
        ("FLOTILLA_MODEL_CONFIG", "/nonexistent", "FLOTILLA_MODEL_CONFIG: /nonexistent is not a folder"),
        ("ETCD_ENDPOINTS", "https://127.0.0.1:2379", "is not of the form http://host:port (check ETCD_ENDPOINTS)"),
        ("NATS_SERVER", "redis://127.0.0.1:4222", "NATS_SERVER: 'redis://127.0.0.1:4222' is not of the form"),
        ("FLOTILLA_LEASE_TTL", "0.5", "FLOTILLA_LEASE_TTL=0.5 is below the minimum 1.0"),
        ("FLOTILLA_STREAM_SILENCE_S", "soon", "FLOTILLA_STREAM_SILENCE_S='soon' is not a number"),
        ("FLOTILLA_STREAM_HEARTBEAT_S", "nan", "FLOTILLA_STREAM_HEARTBEAT_S='nan' is not a finite number"),
        ("FLOTILLA_TOKEN_ECHO_DELAY_MS", "-5", "FLOTILLA_TOKEN_ECHO_DELAY_MS=-5.0 is below the minimum 0.0"),
        ("FLOTILLA_MAX_REQUEST_BYTES", "1k", "FLOTILLA_MAX_REQUEST_BYTES='1k' is not an integer"),
        ("FLOTILLA_DRAIN_S", "long", "FLOTILLA_DRAIN_S='long' is not a number"),
        ("FLOTILLA_LOG", "loud", "FLOTILLA_LOG directive 'loud': unknown level 'loud'"),
    ],
)
def test_a_bad_variable_stops_a_worker_at_start_up_with_one_line_and_exit_2(
    variable: str, value: str, message: str
) -> None:
    # Servers nobody listens on: a variable that slipped through would leave the worker waiting.
    servers = {"NATS_SERVER": f"nats://127.0.0.1:{free_port()}", "ETCD_ENDPOINTS": f"http://127.0.0.1:{free_port()}"}
    result = flotilla("run", "in=dyn://check", "out=echo_full", env={**servers, variable: value}, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_a_variable_goes_through_its_flags_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_ROUTER_MODE", "random")
    assert options("in=http", "out=dyn").router_mode == "random"
    monkeypatch.setenv("FLOTILLA_ROUTER_MODE", "fastest")
    with pytest.raises(ConfigError, match="FLOTILLA_ROUTER_MODE='fastest' is not one of"):
        options("in=http", "out=dyn")


def test_a_bad_variable_is_an_error_even_when_its_flag_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_ROUTER_MODE", "fastest")
    with pytest.raises(ConfigError, match="FLOTILLA_ROUTER_MODE"):
        options("in=http", "out=dyn", "--router-mode", "random")


def test_a_flag_wins_over_its_variable_and_a_blank_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_HTTP_PORT", "9100")
    monkeypatch.setenv("FLOTILLA_CONTEXT_LENGTH", "")
    parsed = options("in=http", "--http-port", "9200")
    assert (parsed.http_port, parsed.context_length) == (9200, None)


def test_every_option_but_verbosity_has_a_variable() -> None:
    parser = build_run_parser()
    flags = {action.option_strings[-1] for action in parser._actions if action.option_strings}
    assert flags - set(parser.variables) == {"--help", "--verbose"}
    assert all(variable.startswith("FLOTILLA_") for variable in parser.variables.values())


def test_help_works_even_with_a_bad_variable_and_documents_the_exit_codes() -> None:
    result = flotilla("run", "--help", env={"FLOTILLA_ROUTER_MODE": "bogus"})
    assert result.returncode == 0
    assert "exit codes" in result.stdout
    assert "RestartPreventExitStatus=2" in result.stdout
    assert "[FLOTILLA_ROUTER_MODE]" in result.stdout


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("bad flag"), 2),
        (ModelError("no such model"), 2),
        (TemplateError("bad template"), 2),
        (ModelUnreachable("hub down"), 1),
        (DiscoveryUnavailable("etcd down"), 1),
        (RequestPlaneUnavailable("NATS down"), 1),
        (BackgroundTaskFailed("watcher died"), 1),
    ],
)
def test_only_what_a_restart_cannot_fix_exits_2(error: FlotillaError, code: int) -> None:
    assert exit_code(error) == code


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


def test_image_limits_come_from_their_flags_or_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_IMAGE_FETCH_TIMEOUT_S", "2.5")
    parsed = options("in=http", "--max-image-bytes", "1000", "--image-domains", "Images.Example.com, cdn.org.")
    domains = ("images.example.com", "cdn.org")
    assert parsed.image_limits == ImageLimits(max_bytes=1000, fetch_timeout_s=2.5, domains=domains)


@pytest.mark.parametrize("command", [["run", "in=text", "out=echo_full"], ["agent", "--help"], ["up", "--help"]])
def test_a_hub_variable_huggingface_hub_cannot_read_stops_every_command_with_one_line(command: list[str]) -> None:
    # huggingface_hub 2.4 raises at import on HF_HUB_ETAG_TIMEOUT=0.5; the agent imported it on `--help` already.
    result = flotilla(*command, env={"HF_HUB_ETAG_TIMEOUT": "0.5"}, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "flotilla: HF_HUB_ETAG_TIMEOUT='0.5' is not a whole number of seconds: huggingface_hub, which downloads "
        "models, reads it as one and cannot start otherwise (set it to 1 or more, or unset it)"
    )


def test_whole_seconds_in_the_hub_variables_pass() -> None:
    result = flotilla(
        "agent", "--help", env={"HF_HUB_ETAG_TIMEOUT": "3", "HF_HUB_DOWNLOAD_TIMEOUT": " 20 "}, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--control-plane" in result.stdout
