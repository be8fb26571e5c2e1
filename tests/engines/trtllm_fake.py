"""A stand-in for TensorRT-LLM's LLM API, shaped as its source shows (TensorRT-LLM needs CUDA and its wheels
do not install here, so out=trtllm is held to this fake).

What each piece follows, in NVIDIA/TensorRT-LLM (1.x):

* ``FakeLlm.generate_async``: ``LLM.generate_async`` (tensorrt_llm/llmapi/llm.py): ``_prepare_sampling_params``
  raises ValueError for a request without ``end_id`` when the LLM has no tokenizer (``skip_tokenizer_init``);
  ``_check_arguments`` raises ValueError for a prompt over ``max_num_tokens`` without chunked prefill (not for a
  generation-only request); then ``GenerationExecutor.generate_async`` (tensorrt_llm/executor/executor.py)
  creates the iteration-result queues on the first call (``_maybe_initialize_iteration_results``) and marks them
  undone on each later one.
* ``FakeLlm.get_kv_cache_events_async`` / ``get_stats_async``: ``GenerationExecutor.aget_kv_events`` asserts that
  its queue exists; ``aget_stats`` prints "Iteration statistics are not available yet" and gives an empty
  iterable until then.
* ``FakeIterationResult``: ``IterationResult`` (tensorrt_llm/executor/result.py): items from a queue; after
  ``timeout`` seconds without one it is done, and stays done until ``mark_undone``.
* ``FakeLoRARequest`` / ``FakeLoraConfig``: ``LoRARequest`` (tensorrt_llm/executor/request.py: ``lora_name``,
  ``lora_int_id``, ``lora_path``; ``generate_async(..., lora_request=...)`` takes one per request) and ``LoraConfig``
  (tensorrt_llm/lora_helper.py: a dataclass of ``lora_dir``, ``max_lora_rank``, ``lora_target_modules``,
  ``max_loras``, ``max_cpu_loras``...).
* ``FakeResult``: a streaming ``RequestOutput``: each step's ``outputs[0]`` holds the whole output so far;
  ``abort()``. Built from a model's token stream, it stops as ``BaseWorker._enqueue_request``
  (tensorrt_llm/executor/base_worker.py) sets the request up: ``end_id=-1`` and no stop words with
  ``ignore_eos``, else at ``end_id`` or a ``stop_token_ids`` token ("stop"), and at ``max_tokens`` ("length").
"""

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

NO_TOKENIZER_MESSAGE = (
    "tokenizer is required to reset end_id if it is None, or you can explicitly specify the end_id for sampling_params"
)


def field(params: Any, name: str, default: Any = None) -> Any:
    """A SamplingParams field, from the fake's SamplingParams or from a plain dict (as older tests pass)."""
    if isinstance(params, dict):
        return params.get(name, default)
    return getattr(params, name, default)


class FakeSamplingParams(SimpleNamespace):
    """tensorrt_llm.SamplingParams: its keyword arguments, as attributes."""


@dataclass(kw_only=True)
class FakeGuidedDecodingParams:
    """tensorrt_llm/sampling_params.py GuidedDecodingParams: one of its fields at a time (``_validate``)."""

    json: str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = sum(value is not None for value in (self.json, self.regex, self.grammar, self.structural_tag))
        if given + self.json_object > 1:
            raise ValueError("Only one guide can be used.")


@dataclass
class FakeSchedulingParams:
    """tensorrt_llm/scheduling_params.py SchedulingParams."""

    attention_dp_rank: int | None = None
    attention_dp_relax: bool | None = None


@dataclass
class FakeLoRARequest:
    """tensorrt_llm/executor/request.py LoRARequest."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"


@dataclass(kw_only=True)
class FakeLoraConfig:
    """tensorrt_llm/lora_helper.py LoraConfig (the fields the worker sets)."""

    lora_dir: list[str] | None = None
    max_lora_rank: int = 64
    lora_target_modules: list[str] | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None


class FakeRequestError(RuntimeError):
    """tensorrt_llm/executor/utils.py RequestError: a per-request error the executor raises."""


class FakeIterationResult:
    """tensorrt_llm/executor/result.py IterationResult."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.done = False
        self.timeout = 2.0
        self._taken = False  # an item went out, and its reader has not come back for the next yet
        self.ended = asyncio.Event()  # set when it ends for want of items (not upstream's: for tests to await)

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout

    def mark_undone(self) -> None:
        self.done = False
        self.ended.clear()

    def __aiter__(self) -> "FakeIterationResult":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._taken:
            # Its reader is back for more, so it has handled the last item (for ``handled``; not upstream's).
            self.queue.task_done()
            self._taken = False
        if self.done:
            raise StopAsyncIteration
        try:
            item = await asyncio.wait_for(self.queue.get(), self.timeout)
        except TimeoutError:
            self.done = True
            self.ended.set()
            raise StopAsyncIteration from None
        self._taken = True
        return item

    async def handled(self) -> None:
        """Return once a reader has taken every item put so far and come back for the next."""
        await self.queue.join()


async def nothing() -> AsyncIterator[dict[str, Any]]:
    """executor.py empty_async_iterable."""
    for item in ():
        yield item


class FakeResult:
    """A RequestOutput of generate_async(streaming=True): each step's outputs[0] holds the output so far."""

    def __init__(self, steps: list[tuple[list[int], str | None]]) -> None:
        self.steps = steps
        self.aborted = False
        self.error: Exception | None = None  # raised after the steps, as the executor's per-request error is

    async def __aiter__(self) -> AsyncIterator[Any]:
        for token_ids, reason in self.steps:
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, finish_reason=reason)])
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self.aborted = True


def decode(model_tokens: list[int], params: Any) -> list[tuple[list[int], str | None]]:
    """The steps TensorRT-LLM streams when the model would produce ``model_tokens``, for ``params``."""
    ignore_eos = bool(field(params, "ignore_eos", False))
    end_id = -1 if ignore_eos else field(params, "end_id")
    stop_words = [] if ignore_eos else list(field(params, "stop_token_ids") or [])
    max_tokens = int(field(params, "max_tokens", 32))
    steps: list[tuple[list[int], str | None]] = []
    produced: list[int] = []
    for token in model_tokens:
        produced.append(token)
        if token == end_id or token in stop_words:
            steps.append((list(produced), "stop"))
            return steps
        if len(produced) >= max_tokens:
            steps.append((list(produced), "length"))
            return steps
        steps.append((list(produced), None))
    steps.append((list(produced), "length"))
    return steps


class FakeLlm:
    """tensorrt_llm.LLM, as far as the worker uses it."""

    def __init__(
        self,
        result: FakeResult | None = None,
        *,
        model_tokens: list[int] | None = None,
        max_num_tokens: int | None = None,
        enable_chunked_prefill: bool = False,
    ) -> None:
        self.result = result
        self.model_tokens = model_tokens
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.calls: list[tuple[Any, ...]] = []
        self.scheduling: list[Any] = []
        self.lora_requests: list[Any] = []
        self.results: list[FakeResult] = []
        self.events: FakeIterationResult | None = None
        self.stats: FakeIterationResult | None = None
        self.stats_unavailable = 0  # the lines aget_stats prints before the first request
        self.shut_down = False

    def generate_async(
        self,
        inputs: Any,
        sampling_params: Any,
        *,
        streaming: bool,
        disaggregated_params: Any = None,
        scheduling_params: Any = None,
        lora_request: Any = None,
    ) -> FakeResult:
        if field(sampling_params, "end_id") is None:
            raise ValueError(NO_TOKENIZER_MESSAGE)
        prompt = inputs["prompt_token_ids"]
        generation_only = getattr(disaggregated_params, "fields", {}).get("request_type") == "generation_only"
        checked = self.max_num_tokens and not self.enable_chunked_prefill and not generation_only
        if checked and len(prompt) > self.max_num_tokens:
            raise ValueError(
                f"The sum of prompt length ({float(len(prompt))}), query length (0) should not exceed "
                f"max_num_tokens ({self.max_num_tokens})"
            )
        for name in ("events", "stats"):
            queue = getattr(self, name)
            if queue is None:
                setattr(self, name, FakeIterationResult())
            else:
                queue.mark_undone()
        if disaggregated_params is None:
            self.calls.append((inputs, sampling_params, streaming))
        else:
            self.calls.append((inputs, sampling_params, streaming, {"disaggregated_params": disaggregated_params}))
        self.scheduling.append(scheduling_params)
        self.lora_requests.append(lora_request)
        if self.model_tokens is not None:
            result = FakeResult(decode(self.model_tokens, sampling_params))
        else:
            assert self.result is not None, "FakeLlm needs a result or the model's tokens"
            result = self.result
        self.results.append(result)
        return result

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> FakeIterationResult:
        assert self.events is not None, "KV Event IterationResult is not properly instantiated."
        self.events.set_timeout(timeout or 2)
        return self.events

    def get_stats_async(self, timeout: float | None = 2) -> Any:
        if self.stats is None:
            self.stats_unavailable += 1
            return nothing()
        self.stats.set_timeout(timeout or 2)
        return self.stats

    def emit_kv_event(self, event: dict[str, Any]) -> None:
        """The executor puts a KV event on its queue (after the first request: the queue exists then)."""
        assert self.events is not None
        self.events.queue.put_nowait(event)

    def emit_stats(self, stat: dict[str, Any]) -> None:
        assert self.stats is not None
        self.stats.queue.put_nowait(stat)

    def shutdown(self) -> None:
        self.shut_down = True


@dataclass
class FakeTrtLlm:
    """The fake tensorrt_llm package that ``TrtLlmEngine.start`` imports, with what it was given."""

    llm: FakeLlm
    llm_kwargs: dict[str, Any]
    cuda_asked: int = 0  # times torch.cuda was asked for the GPU's memory (a CUDA context in the worker)


class FakeNvml:
    """pynvml, as far as the worker uses it: one GPU per index and UUID, with ``free`` and ``total`` bytes."""

    NVMLError = RuntimeError

    def __init__(self, free: int, total: int) -> None:
        self.memory = SimpleNamespace(free=free, total=total, used=total - free)
        self.asked: list[tuple[str, Any]] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self.asked.append(("index", index))
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self.asked.append(("uuid", uuid))
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return self.memory


def install(monkeypatch: pytest.MonkeyPatch, llm: FakeLlm, *, nvml: FakeNvml | None = None) -> FakeTrtLlm:
    """Make ``import tensorrt_llm`` (and its submodules the worker imports) give the fake, ``llm`` its LLM;
    ``torch.cuda.mem_get_info`` counts its calls, and ``pynvml`` is ``nvml`` when given."""
    fake = FakeTrtLlm(llm=llm, llm_kwargs={})

    def make_llm(**kwargs: Any) -> FakeLlm:
        fake.llm_kwargs.update(kwargs)
        return llm

    def mem_get_info(device: int = 0) -> tuple[int, int]:
        fake.cuda_asked += 1
        return (70 * 2**30, 80 * 2**30)

    modules: dict[str, dict[str, Any]] = {
        "tensorrt_llm": {"LLM": make_llm, "SamplingParams": FakeSamplingParams},
        "tensorrt_llm.llmapi": {
            "KvCacheConfig": lambda **kwargs: SimpleNamespace(**kwargs),
            "DisaggregatedParams": lambda **fields: SimpleNamespace(fields=fields),
            "GuidedDecodingParams": FakeGuidedDecodingParams,
        },
        "tensorrt_llm.executor": {},
        "tensorrt_llm.executor.request": {"LoRARequest": FakeLoRARequest},
        "tensorrt_llm.lora_helper": {"LoraConfig": FakeLoraConfig},
        "tensorrt_llm.executor.utils": {"RequestError": FakeRequestError},
        "tensorrt_llm.scheduling_params": {"SchedulingParams": FakeSchedulingParams},
        "torch": {"cuda": SimpleNamespace(mem_get_info=mem_get_info)},
    }
    for name, attributes in modules.items():
        module = ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    if nvml is not None:
        monkeypatch.setitem(sys.modules, "pynvml", nvml)  # type: ignore[arg-type]
    return fake
