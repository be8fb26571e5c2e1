"""The channel layer's settings: Channels' Redis layer, on the Redis that Celery already uses.

``FLOTILLA_REDIS_URL`` names it; unset, the Celery broker's ``FLOTILLA_BROKER_URL`` (default
``redis://127.0.0.1:6379/0``) does. Read by controlplane/settings.py, so it imports no Django model.
"""

from typing import Any

from runtime.config import env_str
from runtime.errors import ConfigError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# A dead Redis must not hold a socket's join (or the publisher's thread) for long: connections give up
# after this; the publisher logs, the socket closes and the browser's ws extension reconnects.
CONNECT_TIMEOUT_S = 2.0
# A read gives up after this. It must outlast the layer's blocking receive (BZPOPMIN, 5 s in
# channels_redis), or every socket idle for 5 s dies: redis-py 8's default read timeout is 5 s too.
READ_TIMEOUT_S = 20.0
# Members of a group are forgotten after this unless they join again: a socket left by a killed process
# stops costing sends. Consumers join again every GROUP_REFRESH_S (controlplane/live/consumers.py).
GROUP_EXPIRY_S = 3600
# Messages waiting for one socket beyond this are dropped (a stalled browser tab): it renders again on
# its next change anyway.
CHANNEL_CAPACITY = 500


def redis_url() -> tuple[str, str]:
    """The Redis URL of the channel layer and the variable it came from. Raises ConfigError for a URL
    that is not Redis (``redis://``, ``rediss://``, ``unix://``; Celery's ``redis+socket://`` is taken)."""
    for variable in ("FLOTILLA_REDIS_URL", "FLOTILLA_BROKER_URL"):
        url = env_str(variable)
        if url:
            break
    else:
        return DEFAULT_REDIS_URL, "the default"
    if url.startswith("redis+socket://"):  # Celery's name for a Unix socket; redis-py's is unix://
        url = "unix://" + url.removeprefix("redis+socket://")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{variable}={url!r} is not a Redis URL (redis://HOST:PORT/DB); the dashboard's live updates need "
            "Redis: set FLOTILLA_REDIS_URL"
        )
    return url, variable


def channel_layers() -> dict[str, Any]:
    """Django's ``CHANNEL_LAYERS`` setting. Raises ConfigError as ``redis_url``."""
    url, _ = redis_url()
    return {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [
                    {"address": url, "socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": READ_TIMEOUT_S}
                ],
                "group_expiry": GROUP_EXPIRY_S,
                "capacity": CHANNEL_CAPACITY,
            },
        }
    }
