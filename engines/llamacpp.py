"""The llama.cpp engine (llama-cpp-python), the default: GGUF models on the CPU.

One ``Llama`` context serves one request at a time, so requests queue on a FIFO lock and run on one
worker thread; tokens cross back to the event loop with ``call_soon_threadsafe``. The context keeps
its KV cache between requests and only the part of a new prompt that differs from the cached one is
evaluated, so a shared prefix (a system prompt, a conversation) is reused.

Exact migration. llama.cpp's CPU kernels round a token's KV entry differently when the token is
decoded alone than when it is decoded in a batch of two or more (the size of the batch does not
matter), and its repeat/frequency/presence penalties look only at tokens its sampler produced. A
stream migrated from a dead worker arrives as prompt + generated tokens (``migrated_tokens`` of
them); decoded as one batch and unknown to the penalties, its greedy continuation drifted from the
undisturbed run's (SmolLM2 Q4_1, 5 prompts x 4 cut points: 15 of 19 diverged; the batch decoding
alone: 6 of 20). So the migrated tokens enter the penalty window, and at temperature 0 they are
decoded one at a time, as where they were generated; the prompt is never decoded with a lone token
(a fully cached prompt has its last two decoded again), so that a prompt is decoded the same way
whatever the cache held. Measured: every resumed greedy run equals the undisturbed one, also
across thread counts.

What stays inexact: with temperature > 0 the random generator starts afresh after a migration (a
different sample, so the migrated tokens are decoded as one batch there, which is faster); a
cached prefix that this worker *generated* (the previous answer in a conversation) was decoded
token by token, while a worker without it decodes it as a batch: the next turn's answer (or its
migration) may round its way to a different greedy token there; and builds or CPUs that round
differently differ.
Decoding one at a time costs time: resuming greedily after 400 tokens took ~5 s instead of ~2 s (2
shared cores, 2 threads); a conversation's cached turns are reused as before (first token ~0.08 s).
"""

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runtime.engine import RequestContext
from runtime.errors import EngineError, ModelError, RequestRejected
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, TokenLogprob

log = logging.getLogger(__name__)

# llama.cpp's own defaults (those of llama_cpp.server), used where the request leaves a field unset.
_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1}
_END = object()


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


class LlamaCppEngine:
    """Token engine backed by llama-cpp-python. ``start()`` loads the model."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(self, model_path: Path, *, context_length: int, threads: int | None = None) -> None:
        if model_path.suffix.lower() != ".gguf" or not model_path.is_file():
            raise ModelError(
                f"out=llamacpp needs a GGUF file, and {model_path} is not one; "
                "pass a .gguf path (or a Hugging Face repo with a GGUF file)"
            )
        self.model_path = model_path
        self.context_length = context_length
        self.threads = threads or default_threads()
        self._llama: Any = None
        self._embedder: Any = None  # an embedding-mode context, made by the first embed()
        # One thread owns the llama.cpp context; the lock queues requests in arrival order.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacpp")
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise ModelError(
                "out=llamacpp needs llama-cpp-python; install it with `make install` "
                "(it is built from source with portable CPU flags)"
            ) from exc
        loop = asyncio.get_running_loop()

        def load() -> Any:
            return llama_cpp.Llama(
                model_path=str(self.model_path),
                n_ctx=self.context_length,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                verbose=False,
            )

        try:
            self._llama = await loop.run_in_executor(self._executor, load)
        except (ValueError, RuntimeError) as exc:
            raise ModelError(f"llama.cpp could not load {self.model_path}: {exc}") from exc
        log.info(
            "llama.cpp loaded %s (context %d, %d threads)",
            self.model_path.name,
            self.context_length,
            self.threads,
        )

    async def close(self) -> None:
        llama, self._llama = self._llama, None
        embedder, self._embedder = self._embedder, None
        loop = asyncio.get_running_loop()
        for context in (llama, embedder):
            if context is not None:
                await loop.run_in_executor(self._executor, context.close)
        self._executor.shutdown(wait=False)

    async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """Mean-pooled, unit-length embeddings of ``texts``, and how many tokens they took.

        A second llama.cpp context, in embedding mode, is made at the first request (the weights are
        memory-mapped, so the two share them); it runs on the engine's one thread, between generations.
        Raises EngineError.
        """
        if self._llama is None:
            raise EngineError("the llama.cpp engine is not started")
        loop = asyncio.get_running_loop()
        try:
            vectors, tokens = await loop.run_in_executor(self._executor, self._embed_blocking, texts)
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"llama.cpp could not embed: {exc}") from exc
        return vectors, tokens

    def _embed_blocking(self, texts: list[str]) -> tuple[list[list[float]], int]:
        if self._embedder is None:
            import llama_cpp

            self._embedder = llama_cpp.Llama(
                model_path=str(self.model_path),
                n_ctx=self.context_length,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                embedding=True,
                pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                verbose=False,
            )
        vectors, tokens = self._embedder.embed(texts, normalize=True, truncate=False, return_count=True)
        return vectors, tokens

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        if self._llama is None:
            raise EngineError("the llama.cpp engine is not started")
        if len(request.token_ids) + request.stop_conditions.max_tokens > self.context_length:
            raise EngineError("the prompt plus max_tokens does not fit the llama.cpp context")
        loop = asyncio.get_running_loop()
        grammar = (
            await loop.run_in_executor(None, json_schema_grammar, request.json_schema) if request.json_schema else None
        )
        queue: asyncio.Queue[Any] = asyncio.Queue()
        async with self._lock:
            if context.stopped:
                return

            def emit(item: Any) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, item)

            job = loop.run_in_executor(self._executor, self._run, request, context, emit, grammar)
            try:
                while True:
                    item = await queue.get()
                    if item is _END:
                        break
                    yield item
                await job  # re-raises what the thread raised
            finally:
                # Reached on normal end, on a stop string / disconnect (aclose), or on cancellation:
                # tell the thread to stop, and keep the lock until it has let go of the context.
                context.stop()
                if not job.done():
                    with contextlib.suppress(Exception):
                        await asyncio.shield(job)

    def _run(
        self, request: PreprocessedRequest, context: RequestContext, emit: Callable[[Any], None], grammar: Any
    ) -> None:
        """Generate on the worker thread, emitting EngineOutput items and then _END."""
        try:
            self._generate_blocking(request, context, emit, grammar)
        except Exception as exc:
            log.exception("llama.cpp failed on request %s", request.request_id)
            emit(EngineOutput([], "error"))
            raise EngineError(f"llama.cpp failed: {exc}") from exc
        finally:
            emit(_END)

    def _generate_blocking(
        self, request: PreprocessedRequest, context: RequestContext, emit: Callable[[Any], None], grammar: Any
    ) -> None:
        llama = self._llama
        stop = request.stop_conditions
        eos_ids = set(request.eos_token_ids)
        eos_ids.add(llama.token_eos())
        kwargs = _sampling_kwargs(request.sampling)
        if request.sampling.seed is not None:
            llama.set_seed(request.sampling.seed)
        if stop.min_tokens > 0 and not stop.ignore_eos:
            kwargs["logits_processor"] = _suppress_tokens_until(eos_ids, stop.min_tokens, len(request.token_ids))
        # llama-cpp-python 0.3's own sampler chain (penalties, then greedy or top-k/p + dist); its
        # ``generate`` would hide the chain, and the migrated tokens must enter its penalty window.
        # The grammar (structured output) masks every token that would break the JSON schema; once the
        # JSON is complete it allows only end-of-generation tokens, so the answer ends there.
        sampler = llama._init_sampler(**kwargs, grammar=grammar)
        try:
            migrated = request.token_ids[len(request.token_ids) - request.migrated_tokens :]
            for token in migrated:
                sampler.accept(token)
            # Only greedy decoding can continue exactly; a sampled continuation gains nothing from
            # the slower one-at-a-time decoding.
            one_at_a_time = request.migrated_tokens if kwargs["temp"] == 0 else 0
            cached = self._prefill(request.token_ids, one_at_a_time)
            self._sample_loop(sampler, request, context, eos_ids, emit, cached)
        finally:
            sampler.close()

    def _prefill(self, token_ids: list[int], one_at_a_time: int) -> int:
        """Bring the context to ``token_ids``, decoding the last ``one_at_a_time`` of them singly.

        Returns how many of them were already in the context (the reused prefix).
        """
        llama = self._llama
        plan = plan_prefill(llama.input_ids[: llama.n_tokens].tolist(), token_ids, one_at_a_time, llama.n_batch)
        if plan.reuse > 0 and not llama._ctx.kv_cache_seq_rm(-1, plan.reuse, -1):
            # A context that cannot drop a suffix (recurrent models) starts afresh.
            plan = plan_prefill([], token_ids, one_at_a_time, llama.n_batch)
        if plan.reuse == 0:
            llama.reset()
        else:
            llama.n_tokens = plan.reuse
        position = llama.n_tokens
        for size in plan.batches:
            llama.eval(token_ids[position : position + size])
            position += size
        for token in token_ids[position:]:
            llama.eval([token])
        return plan.reuse

    def _sample_loop(
        self,
        sampler: Any,
        request: PreprocessedRequest,
        context: RequestContext,
        eos_ids: set[int],
        emit: Callable[[Any], None],
        cached_tokens: int,
    ) -> None:
        llama = self._llama
        stop = request.stop_conditions
        generated = 0
        cached: int | None = cached_tokens  # told once, on the first output
        while True:
            if context.stopped:
                return
            token = sampler.sample(llama._ctx, -1)  # also accepts the token into the penalty window
            if token in eos_ids and not stop.ignore_eos:
                emit(EngineOutput([], "stop", cached))
                return
            generated += 1
            logprobs = None if request.logprobs is None else [token_logprob(llama, token, request.logprobs)]
            if generated >= stop.max_tokens:
                emit(EngineOutput([token], "length", cached, logprobs))
                return
            emit(EngineOutput([token], None, cached, logprobs))
            cached = None
            llama.eval([token])


def token_logprob(llama: Any, token: int, top: int) -> TokenLogprob:
    """``token``'s log probability under the model's own distribution at the last decoded position
    (before temperature, penalties or a grammar, as vLLM and OpenAI report it), and the ``top``
    likeliest tokens there. Costs ~0.3 ms for SmolLM2's 49k-token vocabulary."""
    import numpy as np

    logits = np.ctypeslib.as_array(llama._ctx.get_logits_ith(-1), shape=(llama.n_vocab(),))
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak).sum()))
    likeliest: list[tuple[int, float]] = []
    if top > 0:
        ids = np.argpartition(logits, -top)[-top:]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        likeliest = [(int(i), float(logits[i]) - log_total) for i in ids]
    return TokenLogprob(float(logits[token]) - log_total, likeliest)


@functools.lru_cache(maxsize=64)
def json_schema_grammar(schema: str) -> Any:
    """llama.cpp's grammar for a JSON schema (JSON text), kept for the next request with the same schema.

    Raises RequestRejected when llama.cpp's converter cannot express the schema (it supports most of
    JSON Schema, not all: e.g. ``{"type": "bogus"}`` or a ``$ref`` to another document).
    """
    from llama_cpp.llama_grammar import LlamaGrammar

    try:
        return LlamaGrammar.from_json_schema(schema, verbose=False)
    except Exception as exc:  # the converter raises assertions, ValueErrors, KeyErrors...
        raise RequestRejected(
            f"llama.cpp cannot turn this JSON schema into a grammar: {type(exc).__name__}: {exc}"
        ) from exc


@dataclass(frozen=True)
class PrefillPlan:
    """How to evaluate a request's tokens: keep ``reuse`` cached ones, decode the rest of the batched
    part in ``batches`` (sizes, in order), then the remaining tokens one at a time."""

    reuse: int
    batches: list[int]


def plan_prefill(cached: Sequence[int], token_ids: Sequence[int], one_at_a_time: int, n_batch: int) -> PrefillPlan:
    """The decoding schedule of ``token_ids`` when the context holds ``cached``.

    All but the last ``one_at_a_time`` tokens are decoded in batches of at least two (unless there is
    only one) and at most ``n_batch``, after the longest cached prefix, which is reused; the last
    ``one_at_a_time`` are left to decode singly. Raises EngineError when no token is left to batch.
    """
    prompt = token_ids[: len(token_ids) - one_at_a_time]
    if not prompt:
        raise EngineError("the request has no prompt tokens")
    reuse = 0
    for have, want in zip(cached, prompt, strict=False):
        if have != want:
            break
        reuse += 1
    left = len(prompt) - reuse
    # A lone prompt token would be decoded alone, and something must be decoded to have logits.
    if left == 1 or (left == 0 and one_at_a_time == 0):
        reuse = max(0, len(prompt) - 2)
        left = len(prompt) - reuse
    batches = [n_batch] * (left // n_batch)
    if rest := left % n_batch:
        batches.append(rest)
    if len(batches) > 1 and batches[-1] == 1:
        batches[-2:] = [batches[-2] - 1, 2]
    return PrefillPlan(reuse, batches)


def _sampling_kwargs(sampling: SamplingOptions) -> dict[str, Any]:
    def pick(value: float | int | None, default: float | int) -> float | int:
        return default if value is None else value

    top_k = sampling.top_k
    return {
        "temp": pick(sampling.temperature, _DEFAULTS["temperature"]),
        "top_p": pick(sampling.top_p, _DEFAULTS["top_p"]),
        # OpenAI-style -1 (and 0) mean "no top-k"; llama.cpp spells that 0.
        "top_k": _DEFAULTS["top_k"] if top_k is None else max(top_k, 0),
        "min_p": pick(sampling.min_p, _DEFAULTS["min_p"]),
        "repeat_penalty": pick(sampling.repetition_penalty, _DEFAULTS["repeat_penalty"]),
        "frequency_penalty": pick(sampling.frequency_penalty, 0.0),
        "presence_penalty": pick(sampling.presence_penalty, 0.0),
    }


def _suppress_tokens_until(token_ids: set[int], min_tokens: int, prompt_length: int) -> list[Callable[..., Any]]:
    """A llama.cpp logits processor that forbids ``token_ids`` (EOS) until min_tokens are generated."""
    ids = sorted(token_ids)

    def processor(input_ids: Any, scores: Any) -> Any:
        if len(input_ids) - prompt_length < min_tokens:
            scores[ids] = float("-inf")
        return scores

    return [processor]
