"""LoRA adapters on the TensorRT-LLM engine, against the fake TensorRT-LLM (tests/engines/trtllm_fake.py).

TensorRT-LLM has no load call: a request names its adapter, ``LLM.generate_async(..., lora_request=LoRARequest(
lora_name, lora_int_id, lora_path))`` (tensorrt_llm/llmapi/llm.py; tensorrt_llm/executor/request.py), and the
executor caches it by ``lora_int_id``; the LLM is built with ``lora_config=LoraConfig(...)``
(tensorrt_llm/lora_helper.py), as TensorRT-LLM's examples/llm-api/llm_multilora.py does.
"""

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engines.shared.gpu_engine_args import GpuPlacement
from engines.trtllm import engine as trtllm_engine
from engines.trtllm.engine import TrtLlmEngine, llm_kwargs
from runtime.engine import RequestContext
from runtime.errors import EngineError
from runtime.lora import lora_id
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.engines.trtllm_fake import FakeLlm, FakeLoraConfig, FakeLoRARequest, FakeTrtLlm, install


def request(lora_name: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r1",
        model="m",
        token_ids=[1, 2, 3],
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=8),
        eos_token_ids=[2],
        lora_name=lora_name,
    )


def adapter(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    return folder


async def run(engine: TrtLlmEngine, req: PreprocessedRequest) -> list[int]:
    return [token async for out in engine.generate(req, RequestContext(req.request_id)) for token in out.token_ids]


@pytest.fixture
async def with_lora(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[TrtLlmEngine, FakeLlm, FakeTrtLlm]]:
    """A worker with LoRA for 2 adapters, started on the fake TensorRT-LLM; closed after the test."""
    monkeypatch.setattr(trtllm_engine, "READ_TIMEOUT_S", 0.01, raising=False)
    llm = FakeLlm(model_tokens=[5, 6, 2])
    fake = install(monkeypatch, llm)
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {}, lora=True, max_loras=2)
    await engine.start()
    yield engine, llm, fake
    await engine.close()


def test_lora_builds_the_llm_with_a_lora_config_for_adapters_named_later() -> None:
    kwargs = llm_kwargs(Path("/m"), GpuPlacement(), {}, max_loras=4)
    config = kwargs["lora_config"]
    assert config["max_loras"] == 4 and config["max_cpu_loras"] == 4
    assert config["max_lora_rank"] == 64 and "attn_q" in config["lora_target_modules"]
    extra = {"lora_config": {"max_lora_rank": 16, "max_cpu_loras": 32}}
    given = llm_kwargs(Path("/m"), GpuPlacement(), extra, max_loras=4)
    assert given["lora_config"]["max_lora_rank"] == 16 and given["lora_config"]["max_cpu_loras"] == 32
    assert "lora_config" not in llm_kwargs(Path("/m"), GpuPlacement(), {})


def test_lora_config_in_the_extra_args_enables_lora_with_its_max_loras() -> None:
    assert TrtLlmEngine(Path("/m"), GpuPlacement(), {"lora_config": {"max_loras": 3}}).max_loras == 3
    assert TrtLlmEngine(Path("/m"), GpuPlacement(), {}).max_loras == 0


async def test_a_loaded_adapter_is_named_on_its_requests_by_its_lora_id_and_refused_once_unloaded(
    with_lora: tuple[TrtLlmEngine, FakeLlm, FakeTrtLlm], tmp_path: Path
) -> None:
    engine, llm, fake = with_lora
    assert isinstance(fake.llm_kwargs["lora_config"], FakeLoraConfig)
    assert fake.llm_kwargs["lora_config"].max_loras == 2
    path = adapter(tmp_path, "sql")
    await engine.load_lora("sql", path)
    await engine.load_lora("sql", path)  # the same again: nothing to do

    assert await run(engine, request("sql")) == [5, 6, 2]
    assert llm.lora_requests[-1] == FakeLoRARequest(lora_name="sql", lora_int_id=lora_id("sql"), lora_path=str(path))
    assert await run(engine, request()) == [5, 6, 2]
    assert llm.lora_requests[-1] is None  # the base model

    await engine.unload_lora("sql")
    await engine.unload_lora("sql")  # not loaded: nothing to do
    calls = len(llm.calls)
    with pytest.raises(EngineError, match="'sql' is not loaded"):
        await run(engine, request("sql"))
    assert len(llm.calls) == calls  # refused before TensorRT-LLM


async def test_loads_past_max_loras_or_without_an_adapter_folder_are_refused(
    with_lora: tuple[TrtLlmEngine, FakeLlm, FakeTrtLlm], tmp_path: Path
) -> None:
    engine, _, _ = with_lora
    with pytest.raises(EngineError, match="not a folder"):
        await engine.load_lora("gone", tmp_path / "gone")
    await engine.load_lora("a", adapter(tmp_path, "a"))
    await engine.load_lora("b", adapter(tmp_path, "b"))
    with pytest.raises(EngineError, match="holds 2 adapters already"):
        await engine.load_lora("c", adapter(tmp_path, "c"))
    await engine.unload_lora("a")
    await engine.load_lora("c", tmp_path / "c")


async def test_a_name_cached_from_one_folder_is_refused_from_another_even_after_an_unload(
    with_lora: tuple[TrtLlmEngine, FakeLlm, FakeTrtLlm], tmp_path: Path
) -> None:
    engine, _, _ = with_lora
    await engine.load_lora("a", adapter(tmp_path, "v1"))
    with pytest.raises(EngineError, match="caches adapters by their id"):
        await engine.load_lora("a", adapter(tmp_path, "v2"))
    await engine.unload_lora("a")
    with pytest.raises(EngineError, match="under a new name"):
        await engine.load_lora("a", tmp_path / "v2")
    await engine.load_lora("a", tmp_path / "v1")  # its first folder again: what TensorRT-LLM cached


async def test_a_worker_started_without_lora_refuses_loads_and_adapter_requests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(trtllm_engine, "READ_TIMEOUT_S", 0.01, raising=False)
    llm = FakeLlm(model_tokens=[5, 2])
    fake = install(monkeypatch, llm)
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    await engine.start()
    try:
        assert "lora_config" not in fake.llm_kwargs
        with pytest.raises(EngineError, match="started without LoRA"):
            await engine.load_lora("a", adapter(tmp_path, "a"))
        with pytest.raises(EngineError, match="started without LoRA"):
            await run(engine, request("a"))
    finally:
        await engine.close()
