"""Where the secret key and the database come from (pure functions over the environment)."""

import os
import stat
from pathlib import Path

import pytest

from controlplane.database import SQLITE_FILE_NAME, database_config
from controlplane.secret_key import DEVELOPMENT_KEY, KEY_FILE_NAME, load_secret_key
from runtime.errors import ConfigError


@pytest.fixture(autouse=True)
def no_configured_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_SECRET_KEY", raising=False)
    monkeypatch.delenv("FLOTILLA_SECRET_KEY_FILE", raising=False)


def test_a_key_file_is_created_once_with_mode_0600_and_reused(tmp_path: Path) -> None:
    first = load_secret_key(tmp_path / "data", debug=False)
    key_file = tmp_path / "data" / KEY_FILE_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(first) >= 50
    assert load_secret_key(tmp_path / "data", debug=False) == first
    assert [path.name for path in key_file.parent.iterdir()] == [KEY_FILE_NAME]  # no temporary file left


def test_the_environment_wins_over_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_SECRET_KEY", "k" * 40)
    assert load_secret_key(tmp_path, debug=False) == "k" * 40
    assert not (tmp_path / KEY_FILE_NAME).exists()


def test_a_key_may_come_from_a_file_named_by_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 40 + "\n")
    monkeypatch.setenv("FLOTILLA_SECRET_KEY_FILE", str(secret))
    assert load_secret_key(tmp_path / "data", debug=False) == "s" * 40


def test_a_short_configured_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_SECRET_KEY", "short")
    with pytest.raises(ConfigError, match=r"FLOTILLA_SECRET_KEY .* under 32 characters"):
        load_secret_key(tmp_path, debug=False)


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    load_secret_key(tmp_path, debug=False)
    (tmp_path / KEY_FILE_NAME).chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by others .*chmod 600"):
        load_secret_key(tmp_path, debug=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_data_dir_is_an_error_outside_debug(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="set FLOTILLA_SECRET_KEY"):
            load_secret_key(tmp_path / "data", debug=False)
        assert load_secret_key(tmp_path / "data", debug=True) == DEVELOPMENT_KEY
    finally:
        tmp_path.chmod(0o700)


def test_a_data_dir_that_is_a_file_is_an_error_outside_debug(tmp_path: Path) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="set FLOTILLA_SECRET_KEY or FLOTILLA_SECRET_KEY_FILE"):
        load_secret_key(blocker, debug=False)
    # Only with FLOTILLA_DEBUG does the built-in development key stand in.
    assert load_secret_key(blocker, debug=True) == DEVELOPMENT_KEY


def test_without_database_url_sqlite_lives_in_the_data_dir(tmp_path: Path) -> None:
    config = database_config(None, tmp_path / "data")
    assert config["ENGINE"] == "django.db.backends.sqlite3"
    assert config["NAME"] == str(tmp_path / "data" / SQLITE_FILE_NAME)
    assert config["OPTIONS"]["transaction_mode"] == "IMMEDIATE"


def test_database_url_selects_postgresql(tmp_path: Path) -> None:
    config = database_config("postgres://flotilla:pw@db.example:5433/fleet", tmp_path)
    assert (config["ENGINE"], config["HOST"], config["PORT"], config["NAME"]) == (
        "django.db.backends.postgresql",
        "db.example",
        5433,
        "fleet",
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [("bogus://x", "DATABASE_URL is not a database URL"), ("mysql://u@h/db", "runs on PostgreSQL or SQLite")],
)
def test_a_database_url_that_cannot_be_used_names_the_variable(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        database_config(url, tmp_path)
