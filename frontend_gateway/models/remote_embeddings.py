"""Embeddings through the request plane: ``POST /v1/embeddings`` for a model served by remote workers.

A worker whose engine embeds (llama.cpp) answers ``EmbedRequest``s on its instance's embed subject
(``ModelEntry.embed_subject``). The ingress cuts a client's inputs (texts or token-id lists) into batches
of at most ``BATCH_TEXTS`` inputs and about ``BATCH_BYTES`` on the wire, so that no batch nears NATS's
payload limit or the progress deadline, and sends them to the embedding instances, one batch in flight per
instance, so a long list is embedded by every worker at once. Embedding has no state and no side effect: a
batch whose instance refuses it (busy, gone, cut off mid-answer) is sent to the next instance, and the
client's request fails only when every instance failed its batch.
"""

import asyncio
import itertools
import logging
from collections.abc import Sequence
from contextlib import aclosing

import msgspec

from frontend_gateway.routing.protocol import InstanceInfo
from runtime.errors import EngineBusy, EngineError, EngineUnavailable, PayloadTooLarge
from runtime.protocol import EmbedInput, EmbedOutput, EmbedRequest, float32_values
from runtime.request_plane import (
    RemoteError,
    RequestClient,
    RequestTooLarge,
    StreamBroken,
    WorkerBusy,
    WorkerUnavailable,
)

log = logging.getLogger(__name__)

#: A batch's bounds: small enough to stay far below NATS's 1 MiB payload and to answer within seconds on
#: a CPU, large enough that a worker embeds several texts per call.
BATCH_TEXTS = 32
BATCH_BYTES = 128 * 1024
#: The most bytes a token id takes in msgpack (a uint32): what a token-id input counts against BATCH_BYTES.
TOKEN_ID_BYTES = 5

_encode = msgspec.msgpack.Encoder().encode
_embed_output = msgspec.msgpack.Decoder(EmbedOutput)


def batches(texts: Sequence[EmbedInput]) -> list[tuple[int, list[EmbedInput]]]:
    """``texts`` (texts or token-id lists) cut into (index of the first, inputs) batches within
    ``BATCH_TEXTS`` and ``BATCH_BYTES``; an input longer than ``BATCH_BYTES`` is a batch of its own."""
    result: list[tuple[int, list[EmbedInput]]] = []
    start, size = 0, 0
    for index, text in enumerate(texts):
        length = len(text.encode()) if isinstance(text, str) else TOKEN_ID_BYTES * len(text)
        if index > start and (index - start >= BATCH_TEXTS or size + length > BATCH_BYTES):
            result.append((start, list(texts[start:index])))
            start, size = index, 0
        size += length
    if start < len(texts):
        result.append((start, list(texts[start:])))
    return result


class RemoteEmbedder:
    """Embeds texts or token ids on a model's instances that serve an embed subject."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._turn = itertools.count()  # which instance takes a request's first batch: round-robin

    async def embed(
        self, client: RequestClient, instances: list[InstanceInfo], request_id: str, texts: Sequence[EmbedInput]
    ) -> tuple[list[list[float]], int]:
        """One vector per input, and the prompt tokens the inputs took.

        Raises EngineUnavailable when no instance embeds or answers, EngineBusy when every one refused as
        busy, PayloadTooLarge for a batch over a worker's limit, EngineError for a worker's failure.
        """
        embedders = [instance for instance in instances if instance.embed_subject is not None]
        if not embedders:
            raise EngineUnavailable(f"no instance of {self.name!r} embeds text now; retry shortly")
        healthy = [instance for instance in embedders if not client.avoided(instance.subject)] or embedders
        first = next(self._turn) % len(healthy)
        order = healthy[first:] + healthy[:first]
        pending = batches(texts)
        vectors: list[list[float]] = [[] for _ in texts]
        tokens = 0

        async def embed_batches(lane: int) -> None:
            # Lane k sends batches k, k + n, ... starting with its own instance, one at a time.
            nonlocal tokens
            for number in range(lane, len(pending), len(order)):
                start, batch = pending[number]
                preferred = order[lane:] + order[:lane]
                for output in await self._embed_batch(client, preferred, f"{request_id}-{number}", batch):
                    for offset, packed in enumerate(output.vectors, start=start + output.start):
                        vectors[offset] = float32_values(packed)
                    tokens += output.prompt_tokens

        try:
            async with asyncio.TaskGroup() as group:
                for lane in range(min(len(order), len(pending))):
                    group.create_task(embed_batches(lane))
        except* (EngineError, PayloadTooLarge) as failures:
            raise failures.exceptions[0] from None
        if any(not vector for vector in vectors):
            raise EngineError(f"an instance of {self.name!r} answered fewer vectors than it was sent texts")
        return vectors, tokens

    async def _embed_batch(
        self, client: RequestClient, instances: list[InstanceInfo], request_id: str, texts: list[EmbedInput]
    ) -> list[EmbedOutput]:
        """The outputs of one batch, from the first of ``instances`` that answers it whole."""
        payload = _encode(EmbedRequest(request_id=request_id, texts=texts))
        busy = False
        for instance in instances:
            assert instance.embed_subject is not None
            try:
                async with aclosing(client.call(instance.embed_subject, request_id, payload)) as frames:
                    return [_embed_output.decode(data) async for frame in frames for data in frame]
            except WorkerBusy:
                busy = True
            except (WorkerUnavailable, StreamBroken) as exc:
                log.info("instance %s of %r did not embed batch %s: %s", instance.name, self.name, request_id, exc)
            except RequestTooLarge as exc:
                raise PayloadTooLarge(f"instance {instance.name} of {self.name!r} refused the texts: {exc}") from exc
            except RemoteError as exc:
                raise EngineError(f"instance {instance.name} of {self.name!r} failed to embed: {exc}") from exc
        if busy:
            raise EngineBusy(f"every instance of {self.name!r} is busy; retry shortly")
        raise EngineUnavailable(f"no instance of {self.name!r} answered; retry shortly")
