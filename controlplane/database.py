"""Which database the control plane uses (``DATABASE_URL`` when set, else SQLite in the data directory),
and the one clock its comparisons of time use: the database's (``db_now``)."""

from datetime import datetime
from pathlib import Path
from typing import Any

import dj_database_url
from django.db import DEFAULT_DB_ALIAS
from django.db.models.functions import Now
from django.db.models.sql import Query

from runtime.errors import ConfigError

SQLITE_FILE_NAME = "controlplane.sqlite3"
_SUPPORTED = ("django.db.backends.postgresql", "django.db.backends.sqlite3")


def database_config(url: str | None, data_dir: Path) -> dict[str, Any]:
    """Django's settings for the default database.

    ``url`` is ``postgres://user:password@host:port/name`` or ``sqlite:////absolute/path``; None means
    SQLite at ``data_dir/controlplane.sqlite3``. Raises ConfigError naming DATABASE_URL when it is malformed
    or names another database.
    """
    if not url:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return _with_sqlite_options({"ENGINE": "django.db.backends.sqlite3", "NAME": str(data_dir / SQLITE_FILE_NAME)})
    try:
        config: dict[str, Any] = dict(dj_database_url.parse(url, conn_health_checks=True))
    except ValueError as exc:
        raise ConfigError(f"DATABASE_URL is not a database URL ({exc}); use postgres://… or sqlite:///…") from exc
    if config.get("ENGINE") not in _SUPPORTED:
        raise ConfigError(f"DATABASE_URL names {config.get('ENGINE')}; the control plane runs on PostgreSQL or SQLite")
    if config["ENGINE"] == "django.db.backends.sqlite3":
        return _with_sqlite_options(config)
    return config


def _with_sqlite_options(config: dict[str, Any]) -> dict[str, Any]:
    # Many agents heartbeat at once: WAL lets readers run beside the one writer, and IMMEDIATE transactions
    # take the write lock at BEGIN, so two writers queue (for up to `timeout` s) instead of one failing with
    # "database is locked" when it upgrades a read lock.
    config["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
    }
    return config


def db_now(using: str = DEFAULT_DB_ALIAS) -> datetime:
    """The database's current time (aware), as ``Now()`` reads it in a query or an update.

    Timestamps that are compared come from this one clock: a heartbeat is stamped with it and the
    reconciler measures silence against it, so control-plane processes on machines whose clocks disagree
    still agree on how long a node has been silent.
    """
    # SELECT Now() with no table, through Django's compiler so that the value is converted as a
    # DateTimeField's would be (SQLite answers text; USE_TZ makes it aware).
    query = Query(None)
    query.add_annotation(Now(), "now")
    (now,) = next(query.get_compiler(using).results_iter())
    assert isinstance(now, datetime)
    return now
