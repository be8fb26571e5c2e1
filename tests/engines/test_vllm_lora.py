"""LoRA adapters on out=vllm with vLLM's CPU build (which runs LoRA: its PunicaWrapperCPU) on SmolLM2: an adapter
loaded at run time changes the greedy answer, its KV events carry its lora id, and once unloaded it is refused.

The adapter is a tiny random PEFT one (tests/engines/peft_adapter.py). Run with `make test-vllm`, or
`PYTHONPATH=$PWD <vllm venv>/bin/python -m pytest -q -m vllm tests/engines/test_vllm_lora.py`."""

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from runtime.engine import RequestContext
from runtime.errors import EngineError
from runtime.kv.events import BlockStored, KvEvent
from runtime.lora import lora_id
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.engines.peft_adapter import write_peft_adapter
from tests.engines.vllm_model import ENGINE_ARGS, KV_CACHE_ENV, VLLM_MARKS

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(vllm_model_folder: Path) -> AsyncIterator[object]:
    from engines.vllm.engine import VllmEngine
    from engines.vllm.settings import VllmSettings, read_extra_args

    os.environ.update(KV_CACHE_ENV)
    settings = VllmSettings(
        model=str(vllm_model_folder), max_model_len=1024, extra=read_extra_args(ENGINE_ARGS), lora=True, max_loras=2
    )
    started = VllmEngine(settings)
    await started.start()
    yield started
    await started.close()


def prompt_ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def request(token_ids: list[int], lora_name: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"lora-{os.urandom(4).hex()}",
        model="smol",
        token_ids=token_ids,
        sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=8, ignore_eos=True),
        lora_name=lora_name,
    )


async def answer(engine: object, req: PreprocessedRequest) -> list[int]:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    return [token async for out in engine.generate(req, RequestContext(req.request_id)) for token in out.token_ids]


@pytest.mark.asyncio(loop_scope="module")
async def test_an_adapter_loaded_at_run_time_changes_the_answer_tags_its_blocks_and_is_refused_once_unloaded(
    engine: object, vllm_model_folder: Path, tmp_path: Path
) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    assert engine.max_loras == 2  # vLLM's settled config
    heard: list[KvEvent] = []
    arrived = asyncio.Event()

    class Sink:
        def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
            heard.extend(events)
            arrived.set()

    engine.attach_kv_events(Sink())
    ids = prompt_ids(vllm_model_folder, "The quick brown fox jumps over the lazy dog. " * 8)  # full KV blocks
    base = await answer(engine, request(ids))

    folder = write_peft_adapter(vllm_model_folder, tmp_path / "tiny")
    await engine.load_lora("tiny", folder)
    await engine.load_lora("tiny", folder)  # the same again: nothing to do
    adapted = await answer(engine, request(ids, "tiny"))
    assert len(adapted) == len(base) == 8
    assert adapted != base
    assert await answer(engine, request(ids)) == base  # the base model is untouched beside it

    async with asyncio.timeout(30):  # vLLM publishes from its engine core process, over ZMQ
        while not any(isinstance(event, BlockStored) and event.lora_id == lora_id("tiny") for event in heard):
            arrived.clear()
            await arrived.wait()

    await engine.unload_lora("tiny")
    with pytest.raises(EngineError, match="'tiny' is not loaded"):
        await answer(engine, request(ids, "tiny"))
    await engine.load_lora("tiny", folder)  # and back, without a restart
    assert await answer(engine, request(ids, "tiny")) == adapted


@pytest.mark.asyncio(loop_scope="module")
async def test_an_adapter_vllm_cannot_load_is_an_engine_error_naming_it(engine: object, tmp_path: Path) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    with pytest.raises(EngineError, match="'broken'"):
        await engine.load_lora("broken", broken)
    assert "broken" not in engine.adapters.book  # type: ignore[union-attr]
