"""LoRA adapters on the llama.cpp engine, for real: a tiny LoRA GGUF for the test SmolLM2 (tests/engines/gguf_lora.py)
loaded at run time changes the greedy answer and is refused once unloaded; requests of two adapters and of the base
model at once each get the answer they get alone (llama.cpp sets an adapter on the whole context, so the steps are
split by adapter: engines/llamacpp/batch.py)."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engines.llamacpp.batch import next_group
from runtime.engine import RequestContext
from runtime.errors import EngineError
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.engines.gguf_lora import write_gguf_lora
from tests.servers import llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.serial,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

PROMPT = "<|im_start|>user\nWrite a poem about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
async def engine(smollm2: Path) -> AsyncIterator[Any]:
    from engines.llamacpp.engine import LlamaCppEngine

    started = LlamaCppEngine(smollm2, context_length=512, threads=2, parallel=3, max_loras=2)
    await started.start()
    yield started
    await started.close()


@pytest.fixture(scope="module")
def adapters(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("loras")
    return {name: write_gguf_lora(smollm2, folder / f"{name}.gguf", seed=seed) for seed, name in enumerate(("a", "b"))}


def request(engine: Any, lora_name: str | None = None, max_tokens: int = 12) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"r-{lora_name}",
        model="smol",
        token_ids=engine.tokenize(PROMPT),
        sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        lora_name=lora_name,
    )


async def answer(engine: Any, req: PreprocessedRequest) -> list[int]:
    return [token async for out in engine.generate(req, RequestContext(req.request_id)) for token in out.token_ids]


def test_the_steps_go_to_each_adapters_requests_in_turn() -> None:
    groups = [None, "b", "a", "b"]
    turns = []
    last, started = None, False
    for _ in range(6):
        last, started = next_group(groups, last, started), True
        turns.append(last)
    assert turns == [None, "a", "b", None, "a", "b"]
    assert next_group(["b"], "a", True) == "b"  # the last group's requests ended: the next one
    assert next_group([None, "a"], "z", True) is None  # round the end


async def test_an_adapter_changes_the_answer_and_is_refused_once_unloaded(
    engine: Any, adapters: dict[str, Path]
) -> None:
    base = await answer(engine, request(engine))
    await engine.load_lora("a", adapters["a"])
    await engine.load_lora("a", adapters["a"])  # the same again: nothing to do
    adapted = await answer(engine, request(engine, "a"))
    assert len(adapted) == len(base) == 12 and adapted != base
    assert await answer(engine, request(engine)) == base  # the slot's adapted cells are no prefix of the base's
    assert await answer(engine, request(engine, "a")) == adapted

    await engine.unload_lora("a")
    await engine.unload_lora("a")  # not loaded: nothing to do
    with pytest.raises(EngineError, match="'a' is not loaded"):
        await answer(engine, request(engine, "a"))
    assert await answer(engine, request(engine)) == base


async def test_requests_of_two_adapters_and_the_base_model_at_once_each_answer_as_alone(
    engine: Any, adapters: dict[str, Path]
) -> None:
    await engine.load_lora("a", adapters["a"])
    await engine.load_lora("b", adapters["b"])
    names = [None, "a", "b"]
    alone = [await answer(engine, request(engine, name)) for name in names]
    assert len({tuple(tokens) for tokens in alone}) == 3
    together = await asyncio.gather(*(answer(engine, request(engine, name)) for name in names))
    assert list(together) == alone
    steps = engine._scheduler.group_steps
    assert steps[None] > 0 and steps["a"] > 0 and steps["b"] > 0


async def test_bad_adapter_files_and_loads_past_max_loras_are_refused_with_a_reason(
    engine: Any, adapters: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(EngineError, match="not a file"):
        await engine.load_lora("gone", tmp_path / "gone.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(EngineError, match="not a LoRA GGUF of this model"):
        await engine.load_lora("junk", junk)
    await engine.load_lora("a", adapters["a"])
    await engine.load_lora("b", adapters["b"])
    with pytest.raises(EngineError, match="holds 2 adapters already"):
        await engine.load_lora("c", adapters["a"])


async def test_unloading_an_adapter_ends_its_running_request_with_an_error(
    engine: Any, adapters: dict[str, Path]
) -> None:
    await engine.load_lora("a", adapters["a"])
    stream = engine.generate(request(engine, "a", max_tokens=400), RequestContext("long"))
    first = await anext(stream)
    assert first.token_ids
    await engine.unload_lora("a")
    with pytest.raises(EngineError, match="'a' was unloaded"):
        async for _ in stream:
            pass
    base = await answer(engine, request(engine))  # the engine goes on
    assert len(base) == 12
