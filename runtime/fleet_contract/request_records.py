"""The request log's records: one per request a gateway finished, published on NATS for the control plane.

Every ingress process publishes what it served, batched about every half second (a ``RecordBatch``, JSON) on
``REQUEST_RECORDS_SUBJECT``; the control plane's bridge (controlplane/live/bridge.py) stores them for the
dashboard's request log and computes the fleet's metric samples from them (controlplane/traffic/). They are
display data: the bridge checks every field against the bounds below at decode time (a batch that breaks one
is refused whole, and logged) and uses them for nothing but showing and summing.

What a record never carries: an API key (only the key's id, which the control plane's database already has),
a prompt or an answer.

``RouteChoice`` is the router's decision as the record tells it; the gateway's router leaves it on the
request's context (runtime/engine.py ``RequestContext.route``) so that the record can carry it.
"""

from typing import Annotated

import msgspec

#: Where every gateway publishes its batches (one subject: the bridge hears every ingress process).
REQUEST_RECORDS_SUBJECT = "flotilla.gateway.request_records"

#: The most records one batch carries; a gateway sends more as further batches.
MAX_BATCH_RECORDS = 500

#: The longest text, and seconds, a record may hold.
MAX_NAME = 256
MAX_SHORT = 64
MAX_SECONDS = 86_400.0 * 365
_MAX_INT = 2**63 - 1
_Count = Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
#: Unix times from 2000 to 9999: a record's arrival.
_Time = Annotated[float, msgspec.Meta(ge=946_684_800.0, le=253_402_300_799.0)]
_Short = Annotated[str, msgspec.Meta(max_length=MAX_SHORT)]
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]


class RouteChoice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where the router sent a request, and why.

    ``mode`` is the router's (``kv``, ``round-robin``, ``random``). The KV router also says how many of the
    prompt's leading blocks the chosen worker held (``overlap_blocks``) out of the prompt's blocks
    (``prompt_blocks``), its cost (routing/kv_scoring.py: the lower, the better) and how many workers were
    weighed (``candidates``); the other routers leave them None.
    """

    mode: _Short
    instance_id: _Count  # the worker's endpoint instance id (63 bits)
    dp_rank: _Count | None = None
    overlap_blocks: _Count | None = None
    prompt_blocks: _Count | None = None
    cost: Annotated[float, msgspec.Meta(ge=-1e18, le=1e18)] | None = None
    candidates: _Count | None = None


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One finished request, as its gateway saw it.

    ``status`` is the HTTP status answered (200 for a stream that failed after it started: ``error`` then
    says what ended it); ``error`` is the OpenAI error type (``invalid_request_error``, ``rate_limit_error``…)
    or ``cancelled`` for a client that left, "" for a success. Times are seconds; ``ttft_s`` and ``itl_s``
    (the mean time between tokens after the first) are None where no token came.
    """

    at: _Time
    request_id: _Name
    model: _Name = ""
    #: ``chat``, ``completions``, ``responses`` or ``embeddings``.
    endpoint: _Short
    status: Annotated[int, msgspec.Meta(ge=100, le=599)]
    error: _Short = ""
    #: The API key's id (the control plane's ``ApiKey`` row), never the key; None when keys are off.
    api_key_id: _Count | None = None
    route: RouteChoice | None = None
    prompt_tokens: _Count = 0
    cached_tokens: _Count | None = None
    completion_tokens: _Count = 0
    ttft_s: _Seconds | None = None
    itl_s: _Seconds | None = None
    duration_s: _Seconds = 0.0


class RecordBatch(msgspec.Struct, frozen=True, kw_only=True):
    """What one gateway publishes at once: its records since its last batch."""

    #: The ingress process (host:pid), for the log of whoever reads a bad batch.
    gateway: _Name
    records: Annotated[list[RequestRecord], msgspec.Meta(max_length=MAX_BATCH_RECORDS)]


encode_batch = msgspec.json.Encoder().encode
#: Raises msgspec.DecodeError (msgspec.ValidationError included) for bytes that are not a batch within bounds.
decode_batch = msgspec.json.Decoder(RecordBatch).decode
