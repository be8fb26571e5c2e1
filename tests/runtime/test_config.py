"""Environment variables are parsed strictly, naming the variable on error."""

from pathlib import Path

import pytest

from runtime.config import env_bool, env_float, env_int, env_str
from runtime.errors import ConfigError
from runtime.settings import check_settings, parse_nats_servers


def test_env_int_parses_and_checks_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_PORT", "8080")
    assert env_int("X_PORT", 1, minimum=1, maximum=65535) == 8080
    monkeypatch.setenv("X_PORT", "eighty")
    with pytest.raises(ConfigError, match="X_PORT='eighty' is not an integer"):
        env_int("X_PORT", 1)
    monkeypatch.setenv("X_PORT", "70000")
    with pytest.raises(ConfigError, match="above the maximum"):
        env_int("X_PORT", 1, maximum=65535)


def test_unset_or_blank_values_fall_back_to_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("X_UNSET", raising=False)
    monkeypatch.setenv("X_BLANK", " ")
    assert env_int("X_UNSET", 3) == 3
    assert env_float("X_BLANK", 2.5) == 2.5
    assert env_bool("X_UNSET", True) is True


def test_env_bool_accepts_the_usual_spellings_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, expected in (("yes", True), ("ON", True), ("0", False), ("false", False)):
        monkeypatch.setenv("X_FLAG", raw)
        assert env_bool("X_FLAG", not expected) is expected
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ConfigError, match="not a boolean"):
        env_bool("X_FLAG", False)


def test_a_secret_can_come_from_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    monkeypatch.delenv("X_TOKEN", raising=False)
    monkeypatch.setenv("X_TOKEN_FILE", str(secret))
    assert env_str("X_TOKEN") == "s3cret"
    monkeypatch.setenv("X_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="cannot be read"):
        env_str("X_TOKEN")


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_env_float_refuses_values_that_slip_past_comparisons(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("X_SECONDS", raw)
    with pytest.raises(ConfigError, match="not a finite number"):
        env_float("X_SECONDS", 1.0, minimum=0.0)


def test_nats_servers_may_be_a_list_and_get_a_scheme() -> None:
    assert parse_nats_servers("127.0.0.1:4222, tls://nats.example:4443") == [
        "nats://127.0.0.1:4222",
        "tls://nats.example:4443",
    ]


@pytest.mark.parametrize("raw", ["", " , ", "http://127.0.0.1:4222", "nats://127.0.0.1:port", "nats://:4222"])
def test_a_malformed_nats_server_is_a_config_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="NATS_SERVER"):
        parse_nats_servers(raw)


def test_check_settings_reads_every_variable_of_the_serving_path(monkeypatch: pytest.MonkeyPatch) -> None:
    check_settings()  # the defaults are fine
    monkeypatch.setenv("ETCD_ENDPOINTS", "http://127.0.0.1:2379,https://127.0.0.1:2379")
    with pytest.raises(ConfigError, match="ETCD_ENDPOINTS"):
        check_settings()
