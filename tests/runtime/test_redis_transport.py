"""The Redis transport Celery uses for a redis:// broker: an acknowledgement that a frozen Redis does not answer
still frees the channel's prefetch slot, so the consumer takes the next message once Redis answers again."""

import signal
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection, Message, Queue
from kombu.transport import resolve_transport

from runtime.fleet_contract.broker import REDIS_CONNECT_TIMEOUT_S, celery_redis_settings
from runtime.fleet_contract.redis_transport import Transport
from tests.infra import RedisServer

SOCKET_TIMEOUT_S = 1.0


@pytest.fixture
def connection(redis_server: RedisServer) -> Iterator[Connection]:
    options = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S}
    with Connection(redis_server.url, transport=Transport, transport_options=options) as conn:
        yield conn


@pytest.mark.timeout(60)
def test_an_ack_redis_does_not_answer_frees_the_prefetch_slot(
    redis_server: RedisServer, connection: Connection
) -> None:
    queue = Queue("tasks", routing_key="tasks")
    with connection.Producer() as producer:
        for number in (1, 2):
            producer.publish({"n": number}, routing_key="tasks", declare=[queue], retry=False)
    received: list[Message] = []
    channel = connection.channel()
    with connection.Consumer(queue, channel=channel, callbacks=[lambda body, message: received.append(message)]) as c:
        c.qos(prefetch_count=1)  # as Celery's workers here: worker_prefetch_multiplier=1, one process
        connection.drain_events(timeout=10)
        [first] = received
        assert not channel.qos.can_consume()  # one in flight: the slot is taken
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(redis.exceptions.TimeoutError):
                first.ack()  # Celery logs this as "Couldn't ack" and goes on
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        assert channel.qos.can_consume()  # kombu's own QoS keeps the slot taken here, for ever
        connection.drain_events(timeout=10)
    assert [message.payload for message in received] == [{"n": 1}, {"n": 2}]


def test_celery_apps_use_it_for_redis_urls_which_their_logs_still_name_so(redis_server: RedisServer) -> None:
    from celery import Celery

    app = Celery("transport-check", broker=redis_server.url, set_as_current=False, fixups=[])
    app.conf.update(**celery_redis_settings())
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        assert type(conn.transport) is Transport
        assert conn.default_channel.client.ping()
        # What Celery's "Connected to ..." and its errors print (":**@" masks the absent password).
        assert conn.as_uri() == redis_server.url.replace("redis://", "redis://:**@")
    assert resolve_transport("memory") is not Transport  # other schemes keep their own
