"""What `flotilla up` tells its control plane: the local model roots include the model it deploys first; the
account bootstrap gets its secrets by environment, and its one JSON line is read back.

tests/controlplane/test_bootstrapaccounts.py runs the bootstrap command itself as the launcher does."""

from pathlib import Path

import pytest

from controlplane.web_security import PRODUCTION, web_security
from launcher.stack.controlplane import (
    ADMIN_TOKEN_FILE,
    ADMIN_USERNAME,
    API_KEY_FILE,
    API_KEY_NAME,
    LOCAL_NODE,
    Bootstrap,
    ControlPlaneError,
    FirstModel,
    bootstrap_command,
    development_notice,
    local_model_roots,
    manage_command,
    parse_bootstrap,
    write_secret,
)
from runtime.models.source import default_model_path


def test_the_roots_are_the_defaults_and_the_first_model_wherever_it_is(tmp_path: Path) -> None:
    first = FirstModel(name="qwen", source_kind="gguf", source="/home/me/Downloads/qwen.gguf", engine="llamacpp")
    roots = local_model_roots(tmp_path, first, environ={}).split(",")
    assert roots == [str(tmp_path / "models"), str(default_model_path().parent), "/home/me/Downloads/qwen.gguf"]


def test_roots_the_user_configured_are_kept(tmp_path: Path) -> None:
    environ = {"FLOTILLA_LOCAL_MODEL_ROOTS": "/srv/models"}
    assert local_model_roots(tmp_path, None, environ=environ) == "/srv/models"


def test_the_bootstrap_gets_its_secrets_by_environment_not_on_the_command_line(tmp_path: Path) -> None:
    write_secret(tmp_path / ADMIN_TOKEN_FILE, "flt_kept_admin")
    write_secret(tmp_path / API_KEY_FILE, "sk-kept")
    argv, env, password = bootstrap_command(tmp_path, api_key=True)
    assert argv[: len(manage_command())] == manage_command()
    assert argv[len(manage_command()) :] == [
        "bootstrapaccounts",
        *("--admin", ADMIN_USERNAME, "--node", LOCAL_NODE, "--api-key-name", API_KEY_NAME),
    ]
    assert env == {
        "FLOTILLA_UP_PASSWORD": password,
        "FLOTILLA_UP_ADMIN_TOKEN": "flt_kept_admin",
        "FLOTILLA_UP_AGENT_TOKEN": "",  # none kept yet
        "FLOTILLA_UP_API_KEY": "sk-kept",
    }
    assert not {password, "flt_kept_admin", "sk-kept"} & set(argv)


def test_without_api_keys_the_bootstrap_is_not_asked_for_one(tmp_path: Path) -> None:
    argv, env, _ = bootstrap_command(tmp_path)
    assert "--api-key-name" not in argv and "FLOTILLA_UP_API_KEY" not in env


def test_the_bootstrap_result_is_its_last_line() -> None:
    output = 'a warning first\n{"admin_created": true, "admin_token": "flt_a", "agent_token": null, "api_key": null}\n'
    assert parse_bootstrap(output) == Bootstrap(admin_created=True, admin_token="flt_a", agent_token=None)
    with pytest.raises(ControlPlaneError, match="printed no result"):
        parse_bootstrap("Traceback (most recent call last): ...")


def test_the_stack_says_which_production_web_settings_its_control_plane_leaves_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in PRODUCTION:
        monkeypatch.delenv(name, raising=False)
    notice = development_notice(web_security())
    assert notice.startswith("  development web settings (plain HTTP on 127.0.0.1; production, deploy/systemd")
    assert all(name in notice for name in PRODUCTION)
    monkeypatch.setenv("FLOTILLA_SECURE_COOKIES", "true")
    assert "FLOTILLA_SECURE_COOKIES" not in development_notice(web_security())
    for name, value in PRODUCTION.items():
        monkeypatch.setenv(name, value)
    assert development_notice(web_security()) == ""
