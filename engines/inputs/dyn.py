"""``in=dyn://ns.comp.ep``: serve an engine as a networked worker instance.

The engine's typed wire structs (runtime/protocol.py) travel as msgpack: token engines take a
``PreprocessedRequest`` and answer ``EngineOutput`` items; text engines take a ``TextRequest`` and
answer ``TextOutput`` items.
"""

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator

import msgspec

from runtime.addressing import EndpointAddress
from runtime.distributed import DistributedRuntime, register_model
from runtime.engine import Engine, RequestContext
from runtime.model_card import ModelCard, ModelType
from runtime.protocol import PreprocessedRequest, TextRequest
from runtime.request_plane import Handler

log = logging.getLogger(__name__)

_token_request = msgspec.msgpack.Decoder(PreprocessedRequest)
_text_request = msgspec.msgpack.Decoder(TextRequest)


def engine_handler(engine: Engine) -> Handler:
    """A bytes-level request handler around ``engine``."""
    encode = msgspec.msgpack.Encoder().encode

    if engine.kind == "token":
        token_engine = engine

        async def token_handler(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
            request = _token_request.decode(payload)
            async for output in token_engine.generate(request, context):
                yield encode(output)

        return token_handler

    text_engine = engine

    async def text_handler(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
        request = _text_request.decode(payload)
        async for output in text_engine.generate(request, context):
            yield encode(output)

    return text_handler


async def serve_worker(address: EndpointAddress, engine: Engine, card: ModelCard) -> None:
    """Register ``card`` on ``address`` and answer requests with ``engine`` until SIGINT/SIGTERM."""
    runtime = await DistributedRuntime.connect()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runtime.shutdown)
    try:
        endpoint = runtime.endpoint(address)
        await endpoint.serve_bytes(engine_handler(engine))
        if engine.kind == "token":
            await register_model(ModelType.TOKENS, endpoint, card=card, skip_special_tokens=engine.skip_special_tokens)
        else:
            await register_model(ModelType.CHAT, endpoint, card=card)
        print(
            f"Flotilla worker {runtime.instance_id:x} (pid {os.getpid()}) serves {card.name!r} on {address}", flush=True
        )
        await runtime.wait_for_shutdown()
        log.info("shutting down worker %x", runtime.instance_id)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await runtime.close()
