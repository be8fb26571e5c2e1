"""The mistral.rs engine (the ``mistralrs`` package): GGUF files or safetensors folders, CPU or GPU.

A *text* engine, because mistral.rs's Python API has no token-level door: its requests take messages
or a prompt string (never token ids), and its streamed chunks carry text deltas (never the sampled
token's id). So Flotilla's router, migration and usage see text here, as for ``out=pystr``.

Every request, chat or completion, is rendered by this engine into one prompt string and sent through
``Runner.send_chat_completion_request(stream=True)``, with the Runner loaded with an *identity* chat
template (``jinja_explicit``: the prompt is used as it is). Why not mistral.rs's own paths:

* its completion request (``send_completion_request``) does not stream, and it holds the Runner for
  the whole generation: the Runner's methods take ``&mut self``, so a second request sent meanwhile
  fails with "Already borrowed" (measured with 0.9.5). The streaming chat request returns as soon as
  the request is queued, so requests are sent under a lock and generate concurrently (mistral.rs
  batches them, up to ``max_seqs``: one by default, see MistralRsSettings);
* the chat template is rendered by ``runtime.models.chat_template`` (transformers' rendering), with the
  request's ``tools``, exactly as Flotilla renders it for the token engines.

Cancellation: dropping the chunk stream drops mistral.rs's receiver; its next token cannot be sent, and
mistral.rs cancels the sequence (``StopReason::Canceled``), freeing its KV cache. A request still
waiting for a free sequence slot is dropped when it is scheduled.

What it refuses (RequestRejected, answered 400): ``min_tokens`` and a per-request ``seed``, which the
Python API does not take (a seed is the engine's: ``--extra-engine-args '{"seed": N}'``).
"""

import asyncio
import concurrent.futures
import logging
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from engines.shared.extra_engine_args import engine_args_source, read_engine_args
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError, ModelError, RequestRejected
from runtime.models.card import ModelCard
from runtime.models.chat_template import ChatTemplate
from runtime.protocol import FinishReason, TextOutput, TextRequest

log = logging.getLogger(__name__)

#: The one line a node without the package prints (exit 2), and where the engine names it.
MISSING_PACKAGE = "out=mistralrs needs the mistralrs package: pip install 'flotilla[mistralrs]'"
_END = object()
# Renders the one message's content as the prompt: Flotilla has rendered the real template already.
_IDENTITY_TEMPLATE = "{{ messages[0]['content'] }}"

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class MistralRsSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """mistral.rs's own settings, by the names of its ``Runner`` and ``Which`` arguments: the keys of
    ``--extra-engine-args`` for ``out=mistralrs``."""

    #: Sequences generated at once (batched); more wait in mistral.rs's queue. One by default, not
    #: mistral.rs's 32: with 0.9.5 on the CPU, a GGUF model fails requests whose prompts are prefilled
    #: in one batch ("input tensor is not contiguous" in its lm_head; 6 of 8 staggered requests with
    #: SmolLM2 Q4_1 at max_seqs 8). Raise it where batching works (a GPU build).
    max_seqs: PositiveInt = 1
    no_kv_cache: bool = False
    #: Finished sequences kept in the prefix cache, for later requests with the same prefix.
    prefix_cache_n: Annotated[int, msgspec.Meta(ge=0)] = 16
    #: In-situ quantization while loading (e.g. "Q4K", "Q8_0").
    in_situ_quant: str | None = None
    #: Model and KV memory: a fraction of GPU memory (0.9) or a KV capacity ("4GiB", "65536tokens").
    memory_goal: str | float | None = None
    pa_blk_size: PositiveInt | None = None
    paged_attn: bool = False
    no_paged_attn: bool = False
    #: The engine's random seed (mistral.rs takes none per request).
    seed: int | None = None
    #: Layers per device, "ORD:NUM" each.
    num_device_layers: list[str] | None = None
    dtype: Literal["auto", "bf16", "f16", "f32"] = "auto"
    #: A GGUF file's tokenizer from this Hugging Face repo or folder instead of the file's own.
    tok_model_id: str | None = None
    topology: str | None = None


KNOWN_KEYS: tuple[str, ...] = MistralRsSettings.__struct_fields__


def parse_settings(raw: Path | str | None) -> MistralRsSettings:
    """The settings in JSON file ``raw``, or in ``raw`` itself when it is a str holding a JSON object (as
    the node agent passes a pipeline's); the defaults when None.

    Raises ConfigError naming the source and the offending key, and listing the known keys.
    """
    if raw is None:
        return MistralRsSettings()
    values = read_engine_args(raw, engine="mistralrs", syntax="json")
    source = engine_args_source(raw)
    known = ", ".join(KNOWN_KEYS)
    for key in values:
        if key not in KNOWN_KEYS:
            raise ConfigError(f"{source}: unknown key {key!r} for out=mistralrs; known keys: {known}")
    try:
        settings = msgspec.convert(values, MistralRsSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}; known keys: {known}") from None
    if settings.paged_attn and settings.no_paged_attn:
        raise ConfigError(f"{source}: paged_attn and no_paged_attn exclude each other: drop one")
    return settings


class MistralRsEngine:
    """Text engine backed by a mistral.rs ``Runner``. ``start()`` loads the model."""

    kind: Literal["text"] = "text"

    def __init__(
        self, model_path: Path, card: ModelCard, settings: MistralRsSettings, *, threads: int | None = None
    ) -> None:
        if not (model_path.is_dir() or (model_path.is_file() and model_path.suffix.lower() == ".gguf")):
            raise ModelError(
                f"out=mistralrs loads a GGUF file or a Hugging Face folder (safetensors), and {model_path} is neither"
            )
        if not card.chat_template:
            raise ModelError(f"{model_path} has no chat template; give one with --model-config FOLDER")
        self.model_path = model_path
        self.card = card
        self.settings = settings
        self.threads = threads
        self._template = ChatTemplate(card.chat_template, bos_token=card.bos_token, eos_token=card.eos_token)
        self._runner: Any = None
        # Each request's stream is read by a thread of its own (the chunk iterator blocks); the lock
        # keeps two threads from borrowing the Runner at once ("Already borrowed").
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.max_seqs, thread_name_prefix="mistralrs"
        )
        self._send_lock = threading.Lock()

    async def start(self) -> None:
        # Before the import and the first parallel kernel: mistral.rs's INFO lines would fill the
        # worker's log, and its thread pool sizes itself once, from the environment.
        os.environ.setdefault("RUST_LOG", "warn")
        if self.threads is not None:
            os.environ["RAYON_NUM_THREADS"] = str(self.threads)
        try:
            import mistralrs
        except ImportError as exc:
            raise ModelError(MISSING_PACKAGE) from exc
        loop = asyncio.get_running_loop()
        try:
            self._runner = await loop.run_in_executor(self._executor, self._load, mistralrs)
        except Exception as exc:  # mistral.rs raises ValueError, RuntimeError or its own for a bad model
            raise ModelError(f"mistral.rs could not load {self.model_path}: {exc}") from exc
        log.info("mistral.rs loaded %s (max_seqs %d)", self.model_path.name, self.settings.max_seqs)

    def _load(self, mistralrs: Any) -> Any:
        settings = self.settings
        dtype = getattr(mistralrs.ModelDType, settings.dtype.upper() if settings.dtype != "auto" else "Auto")
        if self.model_path.is_file():
            which = mistralrs.Which.GGUF(
                quantized_model_id=str(self.model_path.parent),
                quantized_filename=self.model_path.name,
                tok_model_id=settings.tok_model_id,
                topology=settings.topology,
                dtype=dtype,
            )
        else:
            which = mistralrs.Which.Plain(model_id=str(self.model_path), topology=settings.topology, dtype=dtype)
        with tempfile.TemporaryDirectory(prefix="flotilla-mistralrs-") as folder:
            template = Path(folder, "identity.jinja")
            template.write_text(_IDENTITY_TEMPLATE)
            return mistralrs.Runner(
                which=which,
                max_seqs=settings.max_seqs,
                no_kv_cache=settings.no_kv_cache,
                prefix_cache_n=settings.prefix_cache_n,
                # The files are local (Flotilla downloaded them): nothing to fetch with a token.
                token_source="none",
                jinja_explicit=str(template),
                num_device_layers=settings.num_device_layers,
                in_situ_quant=settings.in_situ_quant,
                memory_goal=settings.memory_goal,
                pa_blk_size=settings.pa_blk_size,
                paged_attn=settings.paged_attn,
                no_paged_attn=settings.no_paged_attn,
                seed=settings.seed,
            )

    async def close(self) -> None:
        # Dropping the Runner stops mistral.rs's engine thread and frees the model.
        self._runner = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def generate(self, request: TextRequest, context: RequestContext) -> AsyncIterator[TextOutput]:
        if self._runner is None:
            raise EngineError("the mistral.rs engine is not started")
        import mistralrs

        chat = mistralrs.ChatCompletionRequest(
            messages=[{"role": "user", "content": self.prompt(request)}], model=request.model, **request_fields(request)
        )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        loop.run_in_executor(self._executor, self._stream, chat, context, emit)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # On a stop string, a client gone or a cancellation: the thread drops the stream at its next
            # chunk, which cancels the sequence in mistral.rs. Not awaited: a request still queued there
            # has no chunk to wake its thread until it is scheduled.
            context.stop()

    def prompt(self, request: TextRequest) -> str:
        """The prompt mistral.rs generates from: a completion's as is, a chat rendered by the model's
        template. Raises TemplateError."""
        if request.prompt is not None:
            return request.prompt
        return self._template.render(
            request.messages or [],
            add_generation_prompt=True,
            tools=request.tools,
            **(request.chat_template_kwargs or {}),
        )

    def _stream(self, chat: Any, context: RequestContext, emit: Callable[[Any], None]) -> None:
        """Send ``chat`` and emit its TextOutputs, then _END; an error is emitted as an EngineError."""
        try:
            if context.stopped:
                return
            with self._send_lock:
                chunks = self._runner.send_chat_completion_request(chat)
            try:
                self._relay(chunks, context, emit)
            finally:
                # The stream's receiver goes with it: mistral.rs cancels the sequence at its next token.
                del chunks
        except Exception as exc:  # mistral.rs raises ValueError for its validation and model errors
            emit(EngineError(f"mistral.rs failed: {exc}"))
        finally:
            emit(_END)

    @staticmethod
    def _relay(chunks: Any, context: RequestContext, emit: Callable[[Any], None]) -> None:
        counted = 0
        for chunk in chunks:
            if context.stopped:
                return
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            finish = finish_reason(choice.finish_reason)
            output = TextOutput(text=choice.delta.content or "", finish_reason=finish)
            if finish is not None and chunk.usage is not None:
                # The last chunk carries usage: bill what the chunks before it did not.
                output.completion_tokens = max(chunk.usage.completion_tokens - counted, 0)
                output.prompt_tokens = chunk.usage.prompt_tokens
            counted += output.completion_tokens
            emit(output)
            if finish is not None:
                return


def request_fields(request: TextRequest) -> dict[str, Any]:
    """mistral.rs's sampling and length fields for ``request``. Raises RequestRejected for what it lacks."""
    sampling, stop = request.sampling, request.stop_conditions
    if stop.min_tokens > 0:
        raise RequestRejected("out=mistralrs cannot honour min_tokens: mistral.rs's Python API has no such field")
    if sampling.seed is not None:
        raise RequestRejected(
            "out=mistralrs takes no seed per request (mistral.rs's Python API has none); "
            "the worker's seed is set with --extra-engine-args '{\"seed\": N}'"
        )
    top_k = sampling.top_k
    return {
        "max_tokens": stop.max_tokens,
        "ignore_eos": stop.ignore_eos,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        # OpenAI-style -1 (and 0) mean "no top-k"; mistral.rs spells that None.
        "top_k": top_k if top_k is not None and top_k > 0 else None,
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "stream": True,
    }


def finish_reason(reason: str | None) -> FinishReason | None:
    """mistral.rs's finish reason as Flotilla's ("stop", "length", "canceled", "tool_calls", ...)."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "canceled":
        return "cancelled"
    return "stop"
