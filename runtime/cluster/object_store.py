"""Tokenizers in the NATS JetStream object store, named by their sha256.

A tokenizer can be larger than an etcd value may be, so workers put it here once per content and
model cards in etcd carry only its name.
"""

import hashlib
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from runtime.errors import ConfigError, ModelError

TOKENIZER_BUCKET = "flotilla-tokenizers"


async def publish_tokenizer(nc: NATS, tokenizer_json: str) -> str:
    """Put a tokenizer in the object store (once per content); return its sha256 name."""
    data = tokenizer_json.encode()
    digest = hashlib.sha256(data).hexdigest()
    store = await _object_store(nc)
    try:
        await store.get_info(digest)
    except nats.js.errors.ObjectNotFoundError:
        await store.put(digest, data)
    return digest


async def fetch_tokenizer(nc: NATS, digest: str) -> str:
    """The tokenizer JSON named ``digest``. Raises ModelError if it is not in the store."""
    store = await _object_store(nc)
    try:
        result = await store.get(digest)
    except nats.js.errors.NotFoundError as exc:
        raise ModelError(f"tokenizer {digest[:12]} is not in the object store") from exc
    data: bytes | None = result.data
    if data is None:
        raise ModelError(f"tokenizer {digest[:12]} is empty in the object store")
    return data.decode()


async def _object_store(nc: NATS) -> Any:
    js = nc.jetstream()
    try:
        return await js.object_store(TOKENIZER_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        try:
            return await js.create_object_store(TOKENIZER_BUCKET)
        except nats.js.errors.Error:
            return await js.object_store(TOKENIZER_BUCKET)  # created by another process meanwhile
    except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
        # nats-py 2.16 answers a server without JetStream with ServiceUnavailableError, older ones with
        # NoRespondersError.
        raise ConfigError("NATS has no JetStream: start nats-server with -js (`make services` does)") from exc
