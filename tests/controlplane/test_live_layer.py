"""CHANNEL_LAYERS from the environment (controlplane/live/layer.py)."""

import pytest
from channels_redis.core import RedisChannelLayer

from controlplane.live.layer import DEFAULT_REDIS_URL, channel_layers, redis_url
from runtime.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_REDIS_URL", raising=False)
    monkeypatch.delenv("FLOTILLA_BROKER_URL", raising=False)


def test_the_channel_layer_is_redis_at_flotilla_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_REDIS_URL", "redis://cache:6380/2")
    monkeypatch.setenv("FLOTILLA_BROKER_URL", "redis://broker:6379/0")
    layer = channel_layers()["default"]
    assert layer["BACKEND"] == "channels_redis.core.RedisChannelLayer"
    assert layer["CONFIG"]["hosts"][0]["address"] == "redis://cache:6380/2"


def test_without_its_own_url_it_shares_the_celery_brokers_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_BROKER_URL", "redis://broker:6379/0")
    assert redis_url() == ("redis://broker:6379/0", "FLOTILLA_BROKER_URL")
    monkeypatch.delenv("FLOTILLA_BROKER_URL")
    assert redis_url() == (DEFAULT_REDIS_URL, "the default")


def test_celerys_unix_socket_url_is_translated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_BROKER_URL", "redis+socket:///run/redis/redis.sock")
    assert redis_url()[0] == "unix:///run/redis/redis.sock"


def test_a_url_that_is_not_redis_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_REDIS_URL", "memcached://cache:11211")
    with pytest.raises(ConfigError, match="FLOTILLA_REDIS_URL='memcached://cache:11211' is not a Redis URL"):
        channel_layers()


def test_a_read_outlasts_the_layers_blocking_receive() -> None:
    # Else every socket idle for as long as the receive blocks dies of a read timeout (redis-py 8's
    # default read timeout and channels_redis's blocking receive are both 5 s).
    host = channel_layers()["default"]["CONFIG"]["hosts"][0]
    assert host["socket_timeout"] > RedisChannelLayer.brpop_timeout * 2
