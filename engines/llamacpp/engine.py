"""The llama.cpp engine (llama-cpp-python), the default: GGUF models on the CPU.

One llama.cpp context serves up to ``parallel`` requests at once, as ``llama-server``'s slots do: each
request is a sequence of the context, and one engine thread decodes the next token of every sequence
(and prompt chunks of new ones) in one batch per step (``engines/llamacpp/batch.py``); tokens cross back
to the event loop with ``call_soon_threadsafe``. Each slot keeps its KV cache between requests, and a
new request goes to the slot whose cached tokens share the longest prefix with its prompt: only the rest
is evaluated, so a shared prefix (a system prompt, a conversation) is reused.

Exact migration. llama.cpp's CPU kernels round a token's attention differently when the token is
decoded alone (one token of its sequence in the micro-batch) than in a batch of two or more (how many
does not matter), and its repeat/frequency/presence penalties look only at tokens its sampler
produced. A stream migrated from a dead worker arrives as prompt + generated tokens
(``migrated_tokens`` of them); decoded as one chunk and unknown to the penalties, its greedy
continuation drifted from the undisturbed run's (SmolLM2 Q4_1, 5 prompts x 4 cut points: 15 of 19
diverged; the chunk decoding alone: 6 of 20). So the migrated tokens enter the penalty window, and at
temperature 0 they are decoded one a step, as where they were generated; the prompt is never decoded
with a lone token (a fully cached prompt has its last two decoded again), so that a prompt is decoded
the same way whatever the cache held. Each slot has its own KV stream, so a sequence is decoded the
same way whatever the other slots run (``engines/llamacpp/batch.py``). Measured: every resumed greedy
run equals the undisturbed one, also across thread counts, and a greedy answer among others equals
the answer alone.

What stays inexact: with temperature > 0 the random generator starts afresh after a migration (a
different sample, so the migrated tokens are decoded as one chunk there, which is faster); a
cached prefix that this worker *generated* (the previous answer in a conversation) was decoded
token by token, while a worker without it decodes it as a chunk: the next turn's answer (or its
migration) may round its way to a different greedy token there; and builds or CPUs that round
differently differ.
"""

import asyncio
import importlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engines.llamacpp.batch import END, BatchScheduler, SequenceJob
from engines.llamacpp.embedding import embed_token_ids
from engines.llamacpp.guided import request_grammar
from engines.llamacpp.lora import DEFAULT_MAX_LORAS, load_adapter, unload_adapter
from engines.llamacpp.vision import ImageEncoder, WidenedPrompt
from engines.shared.lora_adapters import LoadedAdapters
from runtime.engine import RequestContext
from runtime.errors import EngineError, ModelError
from runtime.protocol import EmbedInput, EngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)

#: Requests decoded together by default (llama-server's -np); more wait for a free slot. One: each slot holds
#: context_length KV cells, and on small CPUs llama.cpp's kernels are near compute-bound, so 4 rows cost ~3x
#: one step and 4 slots gain first tokens far sooner but little throughput (bench/llamacpp_step_cost.py).
DEFAULT_PARALLEL = 1
#: The longest prompt chunk a step decodes: a long prompt is read over several steps, between which the
#: running requests get their next token.
PROMPT_CHUNK = 256


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


class LlamaCppEngine:
    """Token engine backed by llama-cpp-python. ``start()`` loads the model.

    ``parallel`` requests are decoded together (slots), each up to ``context_length`` tokens. With ``mmproj`` (a
    multimodal projector GGUF) the model takes images, each ``image_tokens`` rows when the card says how many
    (checked at start: the gateway names KV blocks by that count).
    """

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(
        self,
        model_path: Path,
        *,
        context_length: int,
        threads: int | None = None,
        parallel: int = DEFAULT_PARALLEL,
        mmproj: Path | None = None,
        image_tokens: int | None = None,
        lora: bool = False,
        max_loras: int | None = None,
    ) -> None:
        """``max_loras``: how many LoRA adapters (GGUF) it holds at once (engines/llamacpp/lora.py); llama.cpp
        takes adapters without being told at start, so ``lora`` changes nothing (the other engines' argument)."""
        if model_path.suffix.lower() != ".gguf" or not model_path.is_file():
            raise ModelError(
                f"out=llamacpp needs a GGUF file, and {model_path} is not one; "
                "pass a .gguf path (or a Hugging Face repo with a GGUF file)"
            )
        if parallel < 1:
            raise ModelError(f"out=llamacpp needs at least one slot (--parallel), not {parallel}")
        self.model_path = model_path
        self.context_length = context_length
        self.threads = threads or default_threads()
        self.parallel = parallel
        self.mmproj = mmproj
        self._image_tokens = image_tokens
        self._encoder: ImageEncoder | None = None  # images to embeddings, with mmproj
        self._model: Any = None  # llama_cpp._internals.LlamaModel
        self._ctx: Any = None  # its context, one sequence per slot
        self._scheduler: BatchScheduler | None = None
        self._embedder: Any = None  # an embedding-mode context, made by the first embed()
        self.adapters = LoadedAdapters("llama.cpp", max_loras or DEFAULT_MAX_LORAS)

    @property
    def max_loras(self) -> int:
        return self.adapters.max_loras

    async def load_lora(self, name: str, path: Path) -> None:
        """Load the LoRA GGUF ``path`` as ``name``. Raises EngineError."""
        if self.adapters.plan(name, path, kind="file") == "loaded":
            return
        scheduler = self._scheduler
        if scheduler is None:
            raise EngineError(f"cannot load adapter {name!r}: the llama.cpp engine is not started")
        model = self._model
        await asyncio.wrap_future(scheduler.call(lambda: load_adapter(scheduler, model, name, path)))
        self.adapters.add(name, path)

    async def unload_lora(self, name: str) -> None:
        """Unload ``name``: its requests still running end with an error."""
        if self.adapters.pop(name) is None or (scheduler := self._scheduler) is None:
            return
        await asyncio.wrap_future(scheduler.call(lambda: unload_adapter(scheduler, name)))

    async def start(self) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise ModelError(
                "out=llamacpp needs llama-cpp-python; install it with `make install` "
                "(it is built from source with portable CPU flags)"
            ) from exc
        try:
            self._model, self._ctx = await asyncio.to_thread(self._load, llama_cpp)
        except (ValueError, RuntimeError) as exc:
            raise ModelError(f"llama.cpp could not load {self.model_path}: {exc}") from exc
        if self.mmproj is not None:
            try:
                self._encoder = await asyncio.to_thread(self._load_projector, self.mmproj)
            except BaseException:
                await self.close()
                raise
        self._scheduler = BatchScheduler(
            self._model, self._ctx, n_seq=self.parallel, n_batch=PROMPT_CHUNK, plan=plan_prefill
        )
        log.info(
            "llama.cpp loaded %s (context %d, %d slots, %d threads)",
            self.model_path.name,
            self.context_length,
            self.parallel,
            self.threads,
        )

    def _load(self, llama_cpp: Any) -> tuple[Any, Any]:
        # Typed loosely: llama-cpp-python's wrappers have no annotations.
        _internals: Any = importlib.import_module("llama_cpp._internals")

        llama_cpp.llama_backend_init()
        # llama.cpp's log goes through llama-cpp-python's logger, which prints every line (about a thousand at
        # load) until it is told its level: errors only, as llama_cpp.Llama(verbose=False) has it.
        importlib.import_module("llama_cpp._logger").set_verbose(False)
        model = _internals.LlamaModel(
            path_model=str(self.model_path), params=llama_cpp.llama_model_default_params(), verbose=False
        )
        params = llama_cpp.llama_context_default_params()
        # A KV stream of context_length cells per slot (not unified: see engines/llamacpp/batch.py).
        params.n_ctx = self.context_length * self.parallel
        params.n_seq_max = self.parallel
        params.kv_unified = False
        params.n_batch = params.n_ubatch = max(PROMPT_CHUNK, self.parallel)
        params.n_threads = params.n_threads_batch = self.threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        try:
            ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
        except BaseException:
            model.close()
            raise
        return model, ctx

    def _load_projector(self, path: Path) -> ImageEncoder:
        encoder = ImageEncoder(path, self._model, threads=self.threads)
        try:
            # Two sizes: a projector whose images are not all one size of tokens would be named wrongly by a
            # gateway that took the card's count for each.
            counts = {encoder.image_tokens(64, 48), encoder.image_tokens(300, 500)}
            if self._image_tokens is not None and counts != {self._image_tokens}:
                raise ModelError(
                    f"the projector {path} makes {sorted(counts)} tokens of an image, where its metadata says "
                    f"{self._image_tokens}: its file is inconsistent"
                )
        except BaseException:
            encoder.close()
            raise
        log.info("llama.cpp loaded the projector %s (%s tokens an image)", path.name, "/".join(map(str, counts)))
        return encoder

    async def close(self) -> None:
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            embedder, self._embedder = self._embedder, None
            if embedder is not None:
                await asyncio.wrap_future(scheduler.call(embedder.close))
            await asyncio.to_thread(scheduler.close)
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.close()
        ctx, self._ctx = self._ctx, None
        model, self._model = self._model, None
        if ctx is not None:
            ctx.close()
        if model is not None:
            model.close()

    def tokenize(self, text: str) -> list[int]:
        """``text`` as the model's token ids, special tokens parsed (for tests and benchmarks)."""
        if self._model is None:
            raise EngineError("the llama.cpp engine is not started")
        tokens: list[int] = self._model.tokenize(text.encode(), add_bos=False, special=True)
        return tokens

    async def embed(self, inputs: Sequence[EmbedInput]) -> tuple[list[list[float]], int]:
        """Mean-pooled, unit-length embeddings of ``inputs`` (texts, or token ids embedded as given: all of
        one kind), and how many tokens they took.

        A second llama.cpp context, in embedding mode, is made at the first request (the weights are
        memory-mapped, so the two share them); it runs on the engine's one thread, between two steps.
        Raises EngineError.
        """
        if self._scheduler is None:
            raise EngineError("the llama.cpp engine is not started")
        try:
            vectors, tokens = await asyncio.wrap_future(self._scheduler.call(lambda: self._embed_blocking(inputs)))
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"llama.cpp could not embed: {exc}") from exc
        return vectors, tokens

    def _embed_blocking(self, inputs: Sequence[EmbedInput]) -> tuple[list[list[float]], int]:
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
        texts = [item for item in inputs if isinstance(item, str)]
        if not texts:
            return embed_token_ids(self._embedder, [item for item in inputs if isinstance(item, list)])
        if len(texts) < len(inputs):
            raise ValueError("the inputs mix texts and token ids")  # the gateway sends one kind per request
        vectors, tokens = self._embedder.embed(texts, normalize=True, truncate=False, return_count=True)
        return vectors, tokens

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        scheduler = self._scheduler
        if scheduler is None:
            raise EngineError("the llama.cpp engine is not started")
        self.adapters.require(request.lora_name)
        widened = await self._widen(scheduler, request) if request.images else None
        prompt_rows = len(widened.tokens) if widened is not None else len(request.token_ids)
        if prompt_rows + request.stop_conditions.max_tokens > self.context_length:
            raise EngineError("the prompt plus max_tokens does not fit the llama.cpp context")
        loop = asyncio.get_running_loop()
        grammar = None
        if request.json_schema is not None or request.guided is not None:
            grammar = await loop.run_in_executor(None, request_grammar, self._model, request)
        if context.stopped:
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        scheduler.submit(SequenceJob(request, context, emit, grammar, widened))
        try:
            while True:
                item = await queue.get()
                if item is END:
                    break
                if isinstance(item, EngineError):
                    raise item
                yield item
        finally:
            # Reached on normal end, on a stop string / disconnect (aclose), or on cancellation: the
            # engine thread drops the request at its next step, and its slot is free at once.
            context.stop()
            scheduler.wake()

    async def _widen(self, scheduler: BatchScheduler, request: PreprocessedRequest) -> WidenedPrompt:
        """The request's prompt with its images encoded in their placeholders' places (on the engine thread,
        between two steps, as llama-server encodes them in its loop)."""
        encoder, images = self._encoder, request.images or []
        if encoder is None:
            raise EngineError("this model takes no images: serve it with --mmproj (a projector GGUF) to give it some")
        return await asyncio.wrap_future(scheduler.call(lambda: encoder.widen(request.token_ids, images)))

    @property
    def decoded_rows(self) -> int:
        """Token rows decoded so far (prompt chunks and generated tokens; for tests)."""
        return 0 if self._scheduler is None else self._scheduler.decoded_rows


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
