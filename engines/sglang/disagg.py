"""SGLang in disaggregated serving, as its own servers and Dynamo 1.6.1 run it (docs/disaggregation.md).

SGLang moves a prompt's KV itself, after a handshake: the prefill engine listens on a bootstrap port, and a decode
request names the prefill engine's bootstrap host and port and a *room* (a number shared by the two halves of one
request). The prefill half must not be waited for before the decode half is sent: the transfer starts only once
the decode engine has connected. So a prefill worker answers a prefill-only request at once with the handoff
(host, port, room) and lets SGLang's stream run on in the background, and the decode worker passes the three to
``async_generate``. Both engines run with SGLang's ``disaggregation_mode`` set from ``--disagg-role``.
"""

import os
import random
import socket
from typing import Any

from runtime.errors import ConfigError

#: ``KvHandoff.kind`` of an SGLang prefill.
SGLANG_HANDOFF = "sglang"
#: SGLang's default ``disaggregation_bootstrap_port``.
DEFAULT_BOOTSTRAP_PORT = 8998


def disagg_engine_args(role: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """``engine_args`` with SGLang's ``disaggregation_mode`` for a worker of ``role`` ("null" when aggregated).

    Raises ConfigError when ``--extra-engine-args`` set another mode than the role's.
    """
    mode = "null" if role == "aggregated" else role
    given = engine_args.get("disaggregation_mode")
    if given is not None and given != mode:
        raise ConfigError(
            f"--extra-engine-args sets disaggregation_mode {given!r}, but this worker's --disagg-role is {role}: "
            "leave it out (the role sets it)"
        )
    return engine_args if mode == "null" else {**engine_args, "disaggregation_mode": mode}


def bootstrap_address(engine_args: dict[str, Any]) -> tuple[str, int]:
    """Where a prefill engine's bootstrap server listens, as decode engines must reach it: ``$SGLANG_HOST_IP``,
    else the host of ``dist_init_addr``, else this machine's address; and ``disaggregation_bootstrap_port``."""
    port = int(engine_args.get("disaggregation_bootstrap_port", DEFAULT_BOOTSTRAP_PORT))
    host = os.environ.get("SGLANG_HOST_IP") or str(engine_args.get("dist_init_addr") or "").rpartition(":")[0]
    if not host:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return host, port


def new_room() -> int:
    """A bootstrap room: a random non-negative 63-bit number, as Dynamo's frontend draws them."""
    return random.getrandbits(63)


def bootstrap_arguments(params: dict[str, Any]) -> dict[str, Any]:
    """``async_generate``'s bootstrap arguments from a handoff's params. Raises ConfigError if one is missing."""
    try:
        return {name: params[name] for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
    except KeyError as exc:
        raise ConfigError(f"an SGLang KV handoff without {exc.args[0]}") from None
