"""LoRA adapters on the SGLang engine, against a stand-in for SGLang's tokenizer manager.

``FakeLoraTokenizerManager`` follows SGLang's ``TokenizerManager.load_lora_adapter`` / ``unload_lora_adapter``
(python/sglang/srt/managers/tokenizer_manager.py, sglang 0.5.x): a ``LoadLoRAAdapterReqOutput`` with ``success``
False and SGLang's words when LoRA is off or ``max_loaded_loras`` is reached; the request structs are
``LoadLoRAAdapterReqInput(lora_name, lora_path)`` and ``UnloadLoRAAdapterReqInput(lora_name)``
(python/sglang/srt/managers/io_struct.py).
"""

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engines.sglang.engine import SglangEngine, engine_kwargs
from engines.shared.gpu_engine_args import GpuPlacement
from runtime.engine import RequestContext
from runtime.errors import EngineError
from tests.engines.test_sglang import FakeSglang, FakeTokenizerManager, chunk, request


@dataclass
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str


@dataclass
class LoRAUpdateOutput:
    success: bool
    error_message: str | None = None


class FakeLoraTokenizerManager(FakeTokenizerManager):
    """SGLang's tokenizer manager with its LoRA registry: loads checked as SGLang checks them."""

    def __init__(self, server_args: Any) -> None:
        super().__init__(server_args)
        self.registered: dict[str, str] = {}

    async def load_lora_adapter(self, obj: LoadLoRAAdapterReqInput, _: Any = None) -> LoRAUpdateOutput:
        if not self.server_args.enable_lora:
            return LoRAUpdateOutput(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if len(self.registered) >= self.server_args.max_loaded_loras:
            limit = self.server_args.max_loaded_loras
            return LoRAUpdateOutput(False, f"Maximum number of loaded LoRA adapters is {limit}.")
        if obj.lora_name in self.registered:
            return LoRAUpdateOutput(False, f"LoRA adapter {obj.lora_name} is already loaded.")
        self.registered[obj.lora_name] = obj.lora_path
        return LoRAUpdateOutput(True)

    async def unload_lora_adapter(self, obj: UnloadLoRAAdapterReqInput, _: Any = None) -> LoRAUpdateOutput:
        if obj.lora_name not in self.registered:
            return LoRAUpdateOutput(False, f"LoRA adapter {obj.lora_name} is not registered.")
        del self.registered[obj.lora_name]
        return LoRAUpdateOutput(True)


@pytest.fixture
def io_struct(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("sglang.srt.managers.io_struct")
    module.LoadLoRAAdapterReqInput = LoadLoRAAdapterReqInput  # type: ignore[attr-defined]
    module.UnloadLoRAAdapterReqInput = UnloadLoRAAdapterReqInput  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", module)


def adapter(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    return folder


async def started_with_lora(monkeypatch: pytest.MonkeyPatch, max_loras: int = 2) -> tuple[SglangEngine, FakeSglang]:
    fake = FakeSglang([chunk([5], 1, {"type": "stop"})])
    module = types.ModuleType("sglang")

    def engine_of(**kwargs: Any) -> FakeSglang:
        fake.kwargs = kwargs  # type: ignore[attr-defined]
        fake.server_args = types.SimpleNamespace(**kwargs)
        fake.tokenizer_manager = FakeLoraTokenizerManager(fake.server_args)
        return fake

    module.Engine = engine_of  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang", module)

    class Subscriber:
        def __init__(self, endpoint: str, topic: str, on_batch: Any) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr("engines.sglang.engine.ZmqSubscriber", Subscriber)
    engine = SglangEngine(Path("/m"), GpuPlacement(), {}, lora=True, max_loras=max_loras)
    await engine.start()
    return engine, fake


def test_lora_enables_sglangs_lora_with_buffers_for_adapters_loaded_later() -> None:
    kwargs = engine_kwargs(Path("/m"), GpuPlacement(), {}, kv_events_endpoint=None, max_loras=4)
    assert kwargs["enable_lora"] is True and kwargs["max_loaded_loras"] == 4
    assert kwargs["max_loras_per_batch"] == 4  # never above max_loaded_loras: SGLang refuses that
    assert kwargs["max_lora_rank"] == 64 and kwargs["lora_target_modules"] == ["all"]
    given = engine_kwargs(Path("/m"), GpuPlacement(), {"max_lora_rank": 16}, kv_events_endpoint=None, max_loras=16)
    assert given["max_lora_rank"] == 16 and given["max_loras_per_batch"] == 8


def test_without_lora_sglang_gets_no_lora_arguments_and_refuses_a_load() -> None:
    assert "enable_lora" not in engine_kwargs(Path("/m"), GpuPlacement(), {}, kv_events_endpoint=None)
    engine = SglangEngine(Path("/m"), GpuPlacement(), {})
    assert engine.max_loras == 0


def test_enable_lora_in_the_extra_engine_args_enables_it_with_their_max_loaded_loras() -> None:
    engine = SglangEngine(Path("/m"), GpuPlacement(), {"enable_lora": True, "max_loaded_loras": 3})
    assert engine.max_loras == 3


async def test_a_loaded_adapter_runs_requests_by_its_name_and_an_unloaded_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, io_struct: None, tmp_path: Path
) -> None:
    engine, fake = await started_with_lora(monkeypatch)
    path = adapter(tmp_path, "sql")
    await engine.load_lora("sql", path)
    await engine.load_lora("sql", path)  # the same again: nothing to do (SGLang would refuse a second load)
    assert fake.tokenizer_manager.registered == {"sql": str(path)}  # type: ignore[attr-defined]

    with_adapter = request()
    with_adapter.lora_name = "sql"
    outputs = [out async for out in engine.generate(with_adapter, RequestContext("r1"))]
    assert outputs[-1].finish_reason == "stop"
    assert fake.calls[-1]["lora_path"] == "sql"
    base = [out async for out in engine.generate(request(), RequestContext("r2"))]
    assert base and "lora_path" not in fake.calls[-1]

    await engine.unload_lora("sql")
    await engine.unload_lora("sql")  # not loaded: nothing to do
    assert fake.tokenizer_manager.registered == {}  # type: ignore[attr-defined]
    calls = len(fake.calls)
    with pytest.raises(EngineError, match="'sql' is not loaded"):
        async for _ in engine.generate(with_adapter, RequestContext("r3")):
            pass
    assert len(fake.calls) == calls  # refused before SGLang


async def test_loads_past_max_loras_or_of_no_adapter_folder_are_refused_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, io_struct: None, tmp_path: Path
) -> None:
    engine, fake = await started_with_lora(monkeypatch, max_loras=1)
    with pytest.raises(EngineError, match="not a folder"):
        await engine.load_lora("gone", tmp_path / "gone")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match=r"no adapter_config\.json"):
        await engine.load_lora("empty", tmp_path / "empty")
    await engine.load_lora("a", adapter(tmp_path, "a"))
    with pytest.raises(EngineError, match="holds 1 adapters already"):
        await engine.load_lora("b", adapter(tmp_path, "b"))
    assert list(fake.tokenizer_manager.registered) == ["a"]  # type: ignore[attr-defined]


async def test_an_adapter_loaded_again_from_another_folder_replaces_the_first(
    monkeypatch: pytest.MonkeyPatch, io_struct: None, tmp_path: Path
) -> None:
    engine, fake = await started_with_lora(monkeypatch)
    await engine.load_lora("a", adapter(tmp_path, "v1"))
    await engine.load_lora("a", adapter(tmp_path, "v2"))
    assert fake.tokenizer_manager.registered == {"a": str(tmp_path / "v2")}  # type: ignore[attr-defined]


async def test_sglangs_refusal_of_a_load_is_an_engine_error_with_its_words(
    monkeypatch: pytest.MonkeyPatch, io_struct: None, tmp_path: Path
) -> None:
    engine, fake = await started_with_lora(monkeypatch)
    fake.server_args.enable_lora = False
    with pytest.raises(EngineError, match="LoRA is not enabled"):
        await engine.load_lora("a", adapter(tmp_path, "a"))
    assert engine.adapters is not None and "a" not in engine.adapters.book


async def test_a_worker_started_without_lora_refuses_an_adapters_load_and_requests(tmp_path: Path) -> None:
    engine = SglangEngine(Path("/m"), GpuPlacement(), {})
    with pytest.raises(EngineError, match="started without LoRA"):
        await engine.load_lora("a", adapter(tmp_path, "a"))
    engine._engine = FakeSglang([])
    with_adapter = request()
    with_adapter.lora_name = "a"
    with pytest.raises(EngineError, match="started without LoRA"):
        async for _ in engine.generate(with_adapter, RequestContext("r1")):
            pass
