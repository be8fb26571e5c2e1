"""Where the control plane's secret key comes from (it signs sessions and CSRF tokens).

In order: ``FLOTILLA_SECRET_KEY``, the file named by ``FLOTILLA_SECRET_KEY_FILE``, else ``secret_key`` in
the data directory — created at first start with mode 0600, so that a fresh install is safe without any
configuration and every later start (and every process sharing the data directory) uses the same key.
A built-in key is used only with ``FLOTILLA_DEBUG`` and only when the data directory cannot be written.
"""

import contextlib
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

from runtime.config import env_str
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

KEY_FILE_NAME = "secret_key"
DEVELOPMENT_KEY = "insecure-development-key-flotilla-debug-only"
# Django wants at least 50 characters with 5 distinct ones; token_urlsafe(48) gives 64.
_KEY_BYTES = 48


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/flotilla``, else ``~/.local/share/flotilla`` (services set FLOTILLA_DATA_DIR)."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "flotilla"


def load_secret_key(data_dir: Path, *, debug: bool) -> str:
    """Return the secret key (see the module docstring for where it comes from).

    Raises ConfigError naming the variable or the file when no usable key can be had.
    """
    configured = env_str("FLOTILLA_SECRET_KEY")
    if configured is not None:
        if len(configured.strip()) < 32:
            raise ConfigError("FLOTILLA_SECRET_KEY (or the file FLOTILLA_SECRET_KEY_FILE names) is under 32 characters")
        return configured.strip()
    key_path = data_dir / KEY_FILE_NAME
    try:
        return _read_or_create(key_path)
    except OSError as exc:
        if debug:
            log.warning("using the built-in development secret key: %s cannot be used (%s)", key_path, exc.strerror)
            return DEVELOPMENT_KEY
        raise ConfigError(
            f"no secret key: set FLOTILLA_SECRET_KEY or FLOTILLA_SECRET_KEY_FILE, or make {data_dir} writable "
            f"(FLOTILLA_DATA_DIR) so that one is created there ({exc.strerror})"
        ) from exc


def _read_or_create(key_path: Path) -> str:
    """Read the key file, creating it first if it does not exist.

    Raises OSError when the file cannot be read or written, ConfigError when it is unsafe or empty.
    """
    if not key_path.exists():
        _create(key_path)
    mode = key_path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the secret key file {key_path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    key = key_path.read_text().strip()
    if len(key) < 32:
        raise ConfigError(f"the secret key file {key_path} holds under 32 characters; delete it to get a new key")
    return key


def _create(key_path: Path) -> None:
    """Write a new random key atomically; if another process wins the race, its key stands."""
    key_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # mkstemp creates the file 0600; linking it into place fails if the name exists, so two processes
    # starting at once end up with the same key.
    fd, temp_name = tempfile.mkstemp(dir=key_path.parent, prefix=".secret_key.")
    try:
        with os.fdopen(fd, "w") as temp_file:
            temp_file.write(secrets.token_urlsafe(_KEY_BYTES) + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(temp_name, key_path)
    finally:
        os.unlink(temp_name)
