"""kombu's Redis transport, with one fix: an acknowledgement that Redis does not answer still frees its slot.

kombu's Redis ``QoS.ack`` first removes the message from Redis's unacknowledged index, then marks the delivery
done in the channel's prefetch accounting. When Redis does not answer (frozen by SIGSTOP or a fork stall, its
host gone while the connection stays up), the first step raises ``TimeoutError`` after the socket timeout
(broker.py), Celery logs "Couldn't ack" and goes on, and the second step never happens. The channel then counts
the message as in flight for ever; with Flotilla's prefetch of one, ``can_consume()`` stays false and the
worker takes no task again while its connection lives: the reconciler stopped acting, with beat still sending
its passes (a CI run, the frozen-Redis fleet test; celery/celery#2415 is the same symptom).

Here the delivery is marked done in any case. The message stays in Redis's unacknowledged index, and kombu
restores it after the visibility timeout (an hour), as it does for any message whose ack was lost. Flotilla's tasks
bear that: the periodic ones expire first, an agent's task is stamped with its validity and a nonce
(agent/tasks/freshness.py: an old copy is refused), and a batch slice goes on only with a batch that is running and
that no runner holds.

Every Celery app of Flotilla takes it for its ``redis://`` broker: broker.py's ``celery_redis_settings`` registers it
under kombu's alias "redis" (``use_for_redis_urls``), so that URLs and logs still say ``redis://``; naming it in
Celery's ``broker_transport`` would print its module path in their place ("Cannot connect to
runtime.fleet_contract.redis_transport:Transport://...").
"""

from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis


class QoS(kombu_redis.QoS):
    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        finally:
            self._quick_ack(delivery_tag)  # done with in this channel's prefetch count, answered or not


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


#: Where kombu finds it.
TRANSPORT_PATH = f"{__name__}:Transport"


def use_for_redis_urls() -> None:
    """Make kombu (and so Celery) use this transport for every ``redis://`` URL of this process."""
    TRANSPORT_ALIASES["redis"] = TRANSPORT_PATH
