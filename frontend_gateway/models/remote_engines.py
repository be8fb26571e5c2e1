"""Engines that forward to remote workers over the request plane.

A remote token model is an ordinary ``TokenModel`` whose engine is a ``RemoteTokenEngine``: the
gateway pre/post-processes exactly as in one process, and only the token stream crosses NATS. When
the worker dies mid-stream, the engine re-sends the prompt plus the tokens generated so far to
another instance (``migration_limit`` times at most), so the client sees one unbroken stream.

The outputs a worker sent in one frame become one output here (their tokens or text joined), so the
pipeline does one detokenizing pass and one SSE event per frame rather than per engine step.

Instances this ingress found gone (their streams were cut) or stuck (a stream passed the progress deadline)
get no new request for a while (``RequestClient.avoided``), without waiting for their lease to expire. A
new request goes only to instances that are not busy (``Router.busy``; a migrating one was admitted
already), and an instance whose own queue is full refuses it (``WorkerBusy``) and the next is tried: when
none is left, the request is refused as busy (``EngineBusy``, a 503 with Retry-After).

Each attempt at a request is one routing decision, and the router hears how it went: ``prefill_done``
at its first output and ``finished`` exactly once when the attempt is over, however it ends (finished,
failed, cancelled by the client, or broken and about to migrate), so that a router tracking load
never keeps a request that is gone. Busy refusals, migrations (by the cause of the broken stream) and
progress deadlines passed are told to the model's ``health`` (the gateway's metrics), when it has one.
"""

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Literal

import msgspec

from frontend_gateway.models.remote_embeddings import RemoteEmbedder
from frontend_gateway.routing.disagg_policy import DisaggMode, DisaggPolicy, prefill_busy
from frontend_gateway.routing.health import RoutingHealth
from frontend_gateway.routing.protocol import Decision, InstanceInfo, Router
from runtime.distributed import DistributedRuntime
from runtime.engine import RequestContext
from runtime.errors import EngineBusy, EngineError, EngineStalled, EngineUnavailable, PayloadTooLarge, RequestRejected
from runtime.protocol import (
    EmbedInput,
    EngineOutput,
    KvHandoff,
    PreprocessedRequest,
    StopConditions,
    TextOutput,
    TextRequest,
    TokenLogprob,
)
from runtime.request_plane import (
    RemoteError,
    RequestClient,
    RequestRefused,
    RequestTooLarge,
    StreamBroken,
    StreamStalled,
    WorkerBusy,
    WorkerUnavailable,
)

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_engine_output = msgspec.msgpack.Decoder(EngineOutput)
_text_output = msgspec.msgpack.Decoder(TextOutput)


class InstanceSet:
    """The live instances of one model, in a stable order for round-robin."""

    def __init__(self) -> None:
        self._instances: dict[int, InstanceInfo] = {}
        self._snapshot: list[InstanceInfo] = []

    def add(self, instance: InstanceInfo) -> None:
        self._instances[instance.instance_id] = instance
        self._snapshot = sorted(self._instances.values(), key=lambda info: info.instance_id)

    def remove(self, instance_id: int) -> None:
        self._instances.pop(instance_id, None)
        self._snapshot = sorted(self._instances.values(), key=lambda info: info.instance_id)

    def __len__(self) -> int:
        return len(self._snapshot)

    def snapshot(self) -> list[InstanceInfo]:
        return self._snapshot


class _RemoteBase:
    #: Told of busy refusals, migrations and deadlines passed (the gateway's metrics); None: nobody is.
    health: RoutingHealth | None = None
    #: The LoRA adapter this pool serves (runtime/lora.py), named in every request it sends; None: a base model.
    lora_name: str | None = None

    def __init__(
        self, name: str, instances: InstanceSet, router: Router, runtime: DistributedRuntime, migration_limit: int
    ) -> None:
        self.name = name
        self.instances = instances
        self.router = router
        self.runtime = runtime
        self.migration_limit = migration_limit

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _candidates(self, client: RequestClient, tried: set[int], *, admitted: bool = False) -> list[InstanceInfo]:
        """The instances to choose from: not tried yet, not avoided (unless no other is left) and, for a
        request not ``admitted`` yet, not busy. Raises EngineBusy when every one left is busy."""
        instances = self.instances.snapshot()
        untried = [info for info in instances if info.instance_id not in tried] if tried else instances
        healthy = [info for info in untried if not client.avoided(info.subject)]
        candidates = healthy or untried
        if admitted or not candidates:
            return candidates
        busy = self.router.busy
        free = [info for info in candidates if not busy(info.instance_id)]
        if not free:
            raise self._all_busy()
        return free

    def _out_of_instances(self, busy_refusals: bool, generated: bool) -> EngineError:
        """What to raise when no instance is left to try."""
        if generated:
            return EngineError(f"the worker of {self.name!r} stopped mid-stream and no other instance is left")
        if busy_refusals:
            return self._all_busy()
        return EngineUnavailable(f"no instance of {self.name!r} is available; retry shortly")

    def _all_busy(self) -> EngineBusy:
        """The refusal to raise when every instance is busy (a 503 ``all_workers_busy``), counted."""
        if self.health is not None:
            self.health.busy_refusal()
        return EngineBusy(f"every instance of {self.name!r} is busy; retry shortly")


class RemoteTokenEngine(_RemoteBase):
    """A token engine that forwards to the model's instances, migrating on a broken stream.

    With prefill workers (``prefill_pool`` gives their engine, the watcher's pool of the model's "prefill"
    instances), a request's prompt is computed on one of them and its KV handed to the decode worker the
    router chose, unless ``disagg`` says the decode worker should compute it: ``prefill()`` runs that leg.
    """

    kind: Literal["token"] = "token"
    #: The engine of the model's prefill instances while it has some (None: every prompt is computed where
    #: it decodes), and where prompts are computed then.
    prefill_pool: Callable[[], "RemoteTokenEngine | None"] | None = None
    disagg: DisaggPolicy = DisaggPolicy()
    #: Instances registered as decode workers joined the pool: a disaggregated model, whose every request is
    #: decided (and counted) even while no prefill worker is there. An aggregated one without prefill workers
    #: skips the policy altogether.
    decode_role = False

    def __init__(
        self,
        name: str,
        instances: InstanceSet,
        router: Router,
        runtime: DistributedRuntime,
        migration_limit: int,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        super().__init__(name, instances, router, runtime, migration_limit)
        self.skip_special_tokens = skip_special_tokens
        self._embedder = RemoteEmbedder(name)
        #: As a prefill pool's engine: prompt tokens this ingress sent each instance and not yet heard done.
        self._prefilling: dict[int, int] = {}

    async def embed(self, texts: Sequence[EmbedInput]) -> tuple[list[list[float]], int]:
        """Embed ``texts`` (texts or token-id lists) on the instances whose workers embed
        (remote_embeddings.py): one unit-length vector per input, and the tokens they took. Raises EngineError
        (EngineUnavailable when none embeds)."""
        client = await self.runtime.client()
        if not client.connected:
            raise EngineUnavailable("the request plane (NATS) is unreachable; retry shortly")
        return await self._embedder.embed(client, self.instances.snapshot(), f"embed-{uuid.uuid4().hex}", texts)

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        if self.lora_name is not None:
            request.lora_name = self.lora_name
        client = await self.runtime.client()
        generated: list[int] = []
        tried: set[int] = set()
        migrations = 0
        busy_refusals = False
        # Where the prompt was computed, once decided: its handoff (remote), or False (local, or no prefill
        # workers); None until the first attempt is routed.
        # A prompt whose log probabilities are asked is computed where they are reported: on the decode worker.
        local = request.prompt_logprobs is not None or not self._disaggregated(context)
        handoff: KvHandoff | Literal[False] | None = False if local else None
        while True:
            if not client.connected:
                raise EngineUnavailable("the request plane (NATS) is unreachable; retry shortly")
            attempt = _resume(request, generated) if generated else request
            decision = self.router.choose(attempt, self._candidates(client, tried, admitted=bool(generated)))
            if decision is None:
                raise self._out_of_instances(busy_refusals, bool(generated))
            instance = decision.instance
            tried.add(instance.instance_id)
            context.served_by = instance.name
            context.route = decision.choice()
            if decision.dp_rank != attempt.dp_rank:
                attempt = msgspec.structs.replace(attempt, dp_rank=decision.dp_rank)
            prefilling = True
            try:
                if handoff is None:
                    handoff = await self._disaggregate(attempt, decision, client, context)
                if handoff and not generated:
                    attempt = msgspec.structs.replace(attempt, handoff=handoff)
                # Closed explicitly: a stream left at its finish would otherwise be finalized by the GC.
                async with aclosing(client.call(instance.subject, request.request_id, _encode(attempt))) as frames:
                    async for frame in frames:
                        if prefilling:
                            prefilling = False
                            self.router.prefill_done(request.request_id)
                        output = merge_engine_outputs([_engine_output.decode(data) for data in frame])
                        if handoff and not generated and output.cached_tokens is not None:
                            # The prompt's KV came from the prefill worker: what it found cached is the client's.
                            output.cached_tokens = handoff.cached_tokens
                        generated.extend(output.token_ids)
                        yield output
                        if output.finish_reason is not None:
                            return
                return
            except WorkerBusy as exc:
                busy_refusals = True
                log.debug("instance %s of %r is busy: %s", instance.name, self.name, exc)
            except WorkerUnavailable as exc:
                log.info(
                    "instance %s of %r did not take request %s: %s", instance.name, self.name, request.request_id, exc
                )
            except StreamBroken as exc:
                health = self.health
                if health is not None and isinstance(exc, StreamStalled):
                    health.deadline_expired("progress")
                if migrations >= self.migration_limit:
                    failure = EngineStalled if isinstance(exc, StreamStalled) else EngineError
                    raise failure(
                        f"the worker of {self.name!r} stopped mid-stream ({exc}) and the migration limit "
                        f"({self.migration_limit}) is reached"
                    ) from exc
                migrations += 1
                if health is not None:
                    health.migration(exc.cause)
                log.warning(
                    "migrating request %s of %r after %d tokens (%s); migration %d of %d",
                    request.request_id, self.name, len(generated), exc, migrations, self.migration_limit,
                )  # fmt: skip
            except RequestTooLarge as exc:
                raise PayloadTooLarge(f"instance {instance.name} of {self.name!r} refused the request: {exc}") from exc
            except RequestRefused as exc:
                # The engine's own words on what is wrong with the request: the client's error, a 400.
                raise RequestRejected(str(exc)) from exc
            except RemoteError as exc:
                raise EngineError(f"instance {instance.name} of {self.name!r} failed: {exc}") from exc
            finally:
                self.router.finished(request.request_id)

    def _disaggregated(self, context: RequestContext) -> bool:
        """Whether the request goes through the disaggregation policy: a model with decode workers, or with
        prefill workers now, or a client that said where its prompt goes."""
        if self.prefill_pool is None:
            return False
        return self.decode_role or context.disagg is not None or self.prefill_pool() is not None

    async def _disaggregate(
        self, request: PreprocessedRequest, decision: Decision, client: RequestClient, context: RequestContext
    ) -> KvHandoff | Literal[False]:
        """Where ``request``'s prompt is computed: on a prefill worker (its handoff) or, False, on the decode
        worker ``decision`` chose, which lacks ``decision.prefill_tokens`` of it (as its router believes).
        Counted by reason."""
        prefill = self.prefill_pool() if self.prefill_pool is not None else None
        uncached_tokens = decision.prefill_tokens
        # The decode gate reads the decode worker's KV fill: asked of the router only when there is a gate.
        decode_usage = None
        if self.disagg.decode_busy is not None:
            decode_usage = self.router.kv_usage(decision.instance.instance_id, decision.dp_rank)
        allows_local = self.disagg.decode_allows_local(decode_usage)
        gated = False  # the policy would keep it local, the decode gate says no
        if context.disagg is None:
            reason = self.disagg.decide(len(request.token_ids), uncached_tokens)
            if reason is not None and prefill is not None and not allows_local:
                reason, gated = None, True
        else:
            reason = "header" if context.disagg == "local" else None
        handoff: KvHandoff | None = None
        if reason is None:
            if prefill is None:
                reason = "no_prefill"
            else:
                load_share = self.disagg.prefill_busy if self.disagg.mode is DisaggMode.LOAD else None
                handoff, reason = await prefill.prefill(request, client, context, busy_share=load_share)
                if handoff is None and reason == "load" and not allows_local:
                    # The prefill workers are busy, but the decode worker is fuller still: queue at a prefill worker.
                    handoff, reason = await prefill.prefill(request, client, context)
                    gated = True
                if handoff is not None and (gated or context.disagg is not None):
                    reason = "decode_busy" if gated else "header"
        if self.health is not None:
            self.health.disagg_decision("remote" if handoff is not None else "local", reason)
        if handoff is None:
            return False
        # The decode worker computes none of the prompt: its router counts no prefill load for it from now.
        self.router.prefill_done(request.request_id)
        return handoff

    async def prefill(
        self,
        request: PreprocessedRequest,
        client: RequestClient,
        context: RequestContext,
        *,
        busy_share: float | None = None,
    ) -> tuple[KvHandoff | None, str]:
        """Compute ``request``'s prompt on one of this pool's (prefill) instances: its KV handoff and "policy",
        or None and why none did ("busy", "load", "no_prefill", "prefill_failed"). Instances that refuse or
        fail are each tried once; those past a busy threshold are not (with ``busy_share``, neither are
        those with more prompt tokens in flight from here than that share of their step: "load"). A request
        an instance finds too large is the client's error (PayloadTooLarge). Nothing has reached the client
        yet, so failing here only moves the prompt to the decode worker."""
        prefill_request = msgspec.structs.replace(request, prefill_only=True, handoff=None, dp_rank=None)
        tried: set[int] = set()
        failed = False
        while True:
            candidates = self._candidates(client, tried, admitted=True)
            busy = self.router.busy
            free = [info for info in candidates if not busy(info.instance_id)]
            if candidates and not free:
                return None, "busy"
            if busy_share is not None:
                prefilling = self._prefilling
                free = [
                    info for info in free
                    if not prefill_busy(prefilling.get(info.instance_id, 0), info.prefill_token_capacity, busy_share)
                ]  # fmt: skip
                if candidates and not free:
                    return None, "load"
            decision = self.router.choose(prefill_request, free)
            if decision is None:
                return None, "prefill_failed" if failed else "no_prefill"
            instance = decision.instance
            tried.add(instance.instance_id)
            attempt = prefill_request
            if decision.dp_rank is not None:
                attempt = msgspec.structs.replace(attempt, dp_rank=decision.dp_rank)
            handoff: KvHandoff | None = None
            prompt_tokens = len(request.token_ids)
            self._prefilling[instance.instance_id] = self._prefilling.get(instance.instance_id, 0) + prompt_tokens
            try:
                async with aclosing(client.call(instance.subject, request.request_id, _encode(attempt))) as frames:
                    async for frame in frames:
                        self.router.prefill_done(request.request_id)
                        for data in frame:
                            output = _engine_output.decode(data)
                            if output.handoff is not None:
                                handoff = output.handoff
                if handoff is not None:
                    context.prefilled_by = instance.name
                    return msgspec.structs.replace(handoff, prefill_instance=instance.instance_id), "policy"
                log.warning(
                    "prefill instance %s of %r answered request %s without a KV handoff; the decode worker computes "
                    "the prompt", instance.name, self.name, request.request_id,
                )  # fmt: skip
            except (WorkerBusy, WorkerUnavailable) as exc:
                log.debug(
                    "prefill instance %s of %r did not take request %s: %s",
                    instance.name,
                    self.name,
                    request.request_id,
                    exc,
                )
            except RequestTooLarge as exc:
                raise PayloadTooLarge(f"instance {instance.name} of {self.name!r} refused the request: {exc}") from exc
            except (StreamBroken, RemoteError) as exc:
                log.warning(
                    "the prefill of request %s of %r on instance %s failed (%s); trying elsewhere",
                    request.request_id, self.name, instance.name, exc,
                )  # fmt: skip
            finally:
                self.router.finished(request.request_id)
                if (left := self._prefilling.get(instance.instance_id, 0) - prompt_tokens) > 0:
                    self._prefilling[instance.instance_id] = left
                else:
                    self._prefilling.pop(instance.instance_id, None)
            failed = True


def merge_engine_outputs(outputs: list[EngineOutput]) -> EngineOutput:
    """One output standing for ``outputs`` in order: their tokens up to the first finish reason, and it.

    The first reported ``cached_tokens`` and ``prompt_tokens`` are kept (engines report them on a request's first
    output), as are the prompt's log probabilities (on the first output too), and the tokens' when the engine
    reported them.
    """
    if len(outputs) == 1:
        return outputs[0]
    token_ids: list[int] = []
    cached_tokens = next((output.cached_tokens for output in outputs if output.cached_tokens is not None), None)
    prompt_tokens = next((output.prompt_tokens for output in outputs if output.prompt_tokens is not None), None)
    logprobs: list[TokenLogprob] | None = [] if any(output.logprobs is not None for output in outputs) else None
    prompt = next((output.prompt_logprobs for output in outputs if output.prompt_logprobs is not None), None)
    for output in outputs:
        token_ids += output.token_ids
        if logprobs is not None and output.logprobs is not None:
            logprobs += output.logprobs
        if output.finish_reason is not None:
            return EngineOutput(
                token_ids,
                output.finish_reason,
                cached_tokens,
                logprobs,
                prompt_logprobs=prompt,
                prompt_tokens=prompt_tokens,
            )
    return EngineOutput(
        token_ids, cached_tokens=cached_tokens, logprobs=logprobs, prompt_logprobs=prompt, prompt_tokens=prompt_tokens
    )


def merge_text_outputs(outputs: list[TextOutput]) -> TextOutput:
    """One output standing for ``outputs`` in order: their text and token counts up to the first finish,
    and each one's share of them (``parts``)."""
    if len(outputs) == 1:
        return outputs[0]
    parts: list[tuple[int, int]] = []
    merged = TextOutput(text="", completion_tokens=0, parts=parts)
    texts: list[str] = []
    for output in outputs:
        texts.append(output.text)
        merged.completion_tokens += output.completion_tokens
        parts.append((len(output.text), output.completion_tokens))
        if output.prompt_tokens is not None:
            merged.prompt_tokens = output.prompt_tokens
        if output.finish_reason is not None:
            merged.finish_reason = output.finish_reason
            break
    merged.text = "".join(texts)
    return merged


def _resume(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request to send after a migration: prompt plus what was generated, and only what is left to do."""
    stop = request.stop_conditions
    return msgspec.structs.replace(
        request,
        token_ids=request.token_ids + generated,
        migrated_tokens=request.migrated_tokens + len(generated),
        handoff=None,  # the new instance computes the prompt and tokens so far itself
        prompt_logprobs=None,  # they came with the first output, which was received
        stop_conditions=StopConditions(
            max_tokens=stop.max_tokens - len(generated),
            min_tokens=max(0, stop.min_tokens - len(generated)),
            stop=stop.stop,
            ignore_eos=stop.ignore_eos,
        ),
    )


class RemoteTextEngine(_RemoteBase):
    """A text engine that forwards OpenAI-level requests; text streams cannot be resumed elsewhere."""

    kind: Literal["text"] = "text"

    async def generate(self, request: TextRequest, context: RequestContext) -> AsyncIterator[TextOutput]:
        if self.lora_name is not None:
            request.lora_name = self.lora_name
        client = await self.runtime.client()
        tried: set[int] = set()
        busy_refusals = False
        while True:
            if not client.connected:
                raise EngineUnavailable("the request plane (NATS) is unreachable; retry shortly")
            decision = self.router.choose(request, self._candidates(client, tried))
            if decision is None:
                raise self._out_of_instances(busy_refusals, False)
            instance = decision.instance
            tried.add(instance.instance_id)
            context.served_by = instance.name
            context.route = decision.choice()
            prefilling = True
            try:
                async with aclosing(client.call(instance.subject, request.request_id, _encode(request))) as frames:
                    async for frame in frames:
                        if prefilling:
                            prefilling = False
                            self.router.prefill_done(request.request_id)
                        output = merge_text_outputs([_text_output.decode(data) for data in frame])
                        yield output
                        if output.finish_reason is not None:
                            return
                return
            except WorkerBusy as exc:
                busy_refusals = True
                log.debug("instance %s of %r is busy: %s", instance.name, self.name, exc)
            except WorkerUnavailable as exc:
                log.info(
                    "instance %s of %r did not take request %s: %s", instance.name, self.name, request.request_id, exc
                )
            except RequestTooLarge as exc:
                raise PayloadTooLarge(f"instance {instance.name} of {self.name!r} refused the request: {exc}") from exc
            except StreamStalled as exc:
                if self.health is not None:
                    self.health.deadline_expired("progress")
                raise EngineStalled(f"instance {instance.name} of {self.name!r} stalled: {exc}") from exc
            except (StreamBroken, RemoteError) as exc:
                raise EngineError(f"instance {instance.name} of {self.name!r} failed: {exc}") from exc
            finally:
                self.router.finished(request.request_id)
