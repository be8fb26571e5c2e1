"""The timeouts of every Celery connection to Redis, the control plane's and the agents' alike.

Celery's Redis connections time out only while connecting: kombu's ``socket_timeout`` and Celery's
``redis_socket_timeout`` default to none (kombu) and 120 s (Celery). A Redis that is frozen (SIGSTOPped,
stalled by a fork) or whose host dropped off after the connection was made then hangs every publish
where it stands: in an API request, in the reconciler's pass, in an agent's answer. With these, a publish
fails within ``REDIS_SOCKET_TIMEOUT_S`` and its caller goes on (the reconciler tries again on its next pass),
and keepalives let the kernel notice a peer that is gone.
"""

from typing import Any

from runtime.fleet_contract.redis_transport import use_for_redis_urls

#: Seconds to open a connection to Redis.
REDIS_CONNECT_TIMEOUT_S = 2.0
#: Seconds one command may wait for Redis's answer. Above kombu's BRPOP poll (1 s), which Redis answers
#: within that second when the queue stays empty.
REDIS_SOCKET_TIMEOUT_S = 5.0


def celery_redis_settings(broker_transport_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Celery settings (for ``app.conf.update``) that bound the broker's and the result backend's Redis
    commands; ``broker_transport_options`` adds to the broker's (retry policy and the like). A ``redis://``
    broker gets kombu's transport with a fix, from now on in this process (redis_transport.py)."""
    use_for_redis_urls()
    timeouts = {
        "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
    }
    return {
        "broker_transport_options": {**timeouts, **(broker_transport_options or {})},
        "redis_socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        "redis_socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "redis_socket_keepalive": True,
    }
