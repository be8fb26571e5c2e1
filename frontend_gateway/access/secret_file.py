"""The ingress's API key signing secrets, re-read from their file while it runs: the secret is rotated
without restarting an ingress, and so without a refused request.

The file (``--api-keys-secret-file``) holds one secret per line; a record signed with any of them is
accepted (``runtime/fleet_contract/api_keys.py``). Every ``RELOAD_S`` it is read again (in a thread: a file
read is blocking I/O), and a change is handed to the key table, which applies again the records it has
seen. A file that cannot be read, or holds a bad line (an editor's half-written save), keeps the secrets in
use, with a warning at most once a minute, until it reads well again.
"""

import asyncio
import logging
from pathlib import Path

from frontend_gateway.access.api_keys import KeyTable
from runtime.errors import ConfigError
from runtime.fleet_contract.api_keys import read_secrets
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

#: How often the file is read again: a rotation's steps wait this long for every ingress to follow.
RELOAD_S = 2.0


async def follow_secret_file(path: Path, table: KeyTable, *, period_s: float = RELOAD_S) -> None:
    """Give ``table`` the secrets in ``path`` whenever they change, until cancelled."""
    failing = RateLimitedLog(log, period_s=60.0)
    while True:
        await asyncio.sleep(period_s)
        try:
            secrets = await asyncio.to_thread(read_secrets, path)
        except ConfigError as exc:
            failing.warning(f"API keys: kept the {len(table.secrets)} signing secret(s) in use: {exc}")
            continue
        if table.set_secrets(secrets):
            log.info(
                "API keys: the signing secrets in %s changed; records signed with any of %d accepted",
                path,
                len(secrets),
            )
