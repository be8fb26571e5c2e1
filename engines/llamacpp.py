"""The llama.cpp engine (llama-cpp-python), the default: GGUF models on the CPU.

One ``Llama`` context serves one request at a time, so requests queue on a FIFO lock and run on one
worker thread; tokens cross back to the event loop with ``call_soon_threadsafe``. The context keeps
its KV cache between requests and ``Llama.generate`` re-evaluates only the part of a new prompt that
differs from the previous one, so a shared prefix (a system prompt, a conversation) is reused.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

from runtime.engine import RequestContext
from runtime.errors import EngineError, ModelError
from runtime.protocol import EngineOutput, FinishReason, PreprocessedRequest, SamplingOptions

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
        if llama is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, llama.close)
        self._executor.shutdown(wait=False)

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        if self._llama is None:
            raise EngineError("the llama.cpp engine is not started")
        if len(request.token_ids) + request.stop_conditions.max_tokens > self.context_length:
            raise EngineError("the prompt plus max_tokens does not fit the llama.cpp context")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        async with self._lock:
            if context.stopped:
                return

            def emit(item: Any) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, item)

            job = loop.run_in_executor(self._executor, self._run, request, context, emit)
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

    def _run(self, request: PreprocessedRequest, context: RequestContext, emit: Callable[[Any], None]) -> None:
        """Generate on the worker thread, emitting EngineOutput items and then _END."""
        try:
            self._generate_blocking(request, context, emit)
        except Exception as exc:
            log.exception("llama.cpp failed on request %s", request.request_id)
            emit(EngineOutput([], "error"))
            raise EngineError(f"llama.cpp failed: {exc}") from exc
        finally:
            emit(_END)

    def _generate_blocking(
        self, request: PreprocessedRequest, context: RequestContext, emit: Callable[[Any], None]
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
        generated = 0
        finish: FinishReason = "length"
        tokens = llama.generate(request.token_ids, reset=True, **kwargs)
        try:
            for token in tokens:
                if context.stopped:
                    return
                if token in eos_ids and not stop.ignore_eos:
                    finish = "stop"
                    break
                generated += 1
                if generated >= stop.max_tokens:
                    emit(EngineOutput([token], "length"))
                    return
                emit(EngineOutput([token]))
        finally:
            tokens.close()
        emit(EngineOutput([], finish))


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
