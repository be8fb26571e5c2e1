"""`flotilla agent`'s flags and variables: bad ones stop it with exit code 2 and a message naming them."""

from pathlib import Path

import pytest

from launcher.agent_command import agent_main, agent_settings, build_agent_parser, default_node_name
from launcher.cli import main


@pytest.fixture(autouse=True)
def no_agent_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLOTILLA_CONTROL_PLANE", "FLOTILLA_AGENT_TOKEN", "FLOTILLA_AGENT_TOKEN_FILE", "FLOTILLA_NODE_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("FLOTILLA_GPUS", "FLOTILLA_STATE_DIR", "FLOTILLA_MODELS_DIR", "FLOTILLA_LOG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("FLOTILLA_BROKER_URL", raising=False)
    monkeypatch.delenv("FLOTILLA_HEARTBEAT_S", raising=False)
    monkeypatch.delenv("FLOTILLA_AGENT_RECONCILE_S", raising=False)


def test_the_settings_come_from_flags_and_variables_with_defaults_per_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("flt_secret\n")
    monkeypatch.setenv("FLOTILLA_AGENT_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("FLOTILLA_GPUS", "2x24GiB")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    parser = build_agent_parser()
    namespace = parser.parse_args(["--control-plane", "http://10.0.0.1:8000/", "--name", "gpu-a"])
    settings = agent_settings(parser, namespace)
    assert (settings.control_plane_url, settings.token, settings.node) == (
        "http://10.0.0.1:8000",
        "flt_secret",
        "gpu-a",
    )
    assert settings.simulated_gpus == [24 << 30, 24 << 30]
    assert settings.state_dir == tmp_path / "state" / "flotilla" / "agent-gpu-a"
    assert settings.log_dir == settings.state_dir / "logs"
    assert (settings.broker_url, settings.heartbeat_s, settings.reconcile_s) == ("redis://127.0.0.1:6379/0", 5.0, 30.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--token", "t"], "--control-plane (FLOTILLA_CONTROL_PLANE) is required"),
        (
            ["--control-plane", "http://cp:8000"],
            "--token (FLOTILLA_AGENT_TOKEN or FLOTILLA_AGENT_TOKEN_FILE) is required",
        ),
        (["--control-plane", "cp:8000", "--token", "t"], "is not an http:// or https:// URL"),
        (["--control-plane", "http://cp", "--token", "t", "--name", "GPU_A"], "node name 'GPU_A' is not usable"),
        (["--control-plane", "http://cp", "--token", "t", "--gpus", "2x24"], "'24' is not a size"),
        (["--control-plane", "http://cp", "--token", "t", "--broker", "amqp://q"], "is not a Redis URL"),
        (["--control-plane", "http://cp", "--token", "t", "--heartbeat-s", "0"], "between 0.1 and 3600 seconds"),
    ],
)
def test_a_bad_or_missing_flag_exits_2_naming_it(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_variable_exits_2_naming_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FLOTILLA_HEARTBEAT_S", "often")
    assert main(["agent", "--control-plane", "http://cp:8000", "--token", "t"]) == 2
    assert "FLOTILLA_HEARTBEAT_S: 'often' is not a number of seconds" in capsys.readouterr().err


def test_the_default_node_name_is_the_host_name_as_a_dns_label() -> None:
    assert default_node_name("GPU_Box-7.example.com") == "gpu-box-7"
    assert default_node_name("---") == "node"
