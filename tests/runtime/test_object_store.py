"""The tokenizer object store needs JetStream, and says so when the NATS server lacks it."""

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from runtime.cluster.object_store import fetch_tokenizer, publish_tokenizer
from runtime.errors import ConfigError
from tests.infra import NatsServer


@pytest.fixture
def nats_without_jetstream(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path, jetstream=False)
    server.start()
    yield server
    server.stop()


async def test_a_server_without_jetstream_is_a_config_error_saying_how_to_start_it(
    nats_without_jetstream: NatsServer,
) -> None:
    nc = await nats.connect(nats_without_jetstream.url)
    try:
        with pytest.raises(ConfigError, match="no JetStream: start nats-server with -js"):
            await publish_tokenizer(nc, '{"model": {}}')
    finally:
        await nc.close()


async def test_a_published_tokenizer_is_fetched_by_its_digest(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        digest = await publish_tokenizer(nc, '{"model": {"type": "BPE"}}')
        assert await fetch_tokenizer(nc, digest) == '{"model": {"type": "BPE"}}'
    finally:
        await nc.close()
