"""The llama.cpp engine decodes concurrent requests together (slots), each exactly as it would alone."""

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from runtime.engine import RequestContext
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions
from tests.servers import llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    # serial: llama.cpp's batches use both cores; beside other tests each step would wait for them.
    pytest.mark.serial,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTIONS = (
    "Tell me a long story about a dragon.",
    "Write a poem about the sea.",
    "Explain how photosynthesis works in detail.",
    "List ten fruits and describe each one.",
)


async def started_engine(smollm2: Path, parallel: int) -> Any:
    from engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(smollm2, context_length=2048, threads=2, parallel=parallel)
    await engine.start()
    return engine


@pytest.fixture
async def engine(smollm2: Path) -> AsyncIterator[Any]:
    engine = await started_engine(smollm2, parallel=4)
    yield engine
    await engine.close()


@pytest.fixture
async def two_slots(smollm2: Path) -> AsyncIterator[Any]:
    engine = await started_engine(smollm2, parallel=2)
    yield engine
    await engine.close()


def chatml(engine: Any, content: str, system: str = "You are a helpful AI assistant named SmolLM") -> list[int]:
    """SmolLM2's chat prompt for one user message, as token ids (what the gateway would send)."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    tokens: list[int] = engine.tokenize(text)
    return tokens


def request(token_ids: list[int], max_tokens: int, migrated_tokens: int = 0, **sampling: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r",
        model=MODEL,
        token_ids=token_ids,
        sampling=SamplingOptions(**{"temperature": 0.0, **sampling}),
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        migrated_tokens=migrated_tokens,
    )


class Stream:
    """One request's outputs, each with the time it arrived."""

    def __init__(self, engine: Any, token_ids: list[int], max_tokens: int, **fields: Any) -> None:
        self.context = RequestContext("r")
        self.outputs: list[EngineOutput] = []
        self.times: list[float] = []
        self._generate = engine.generate(request(token_ids, max_tokens, **fields), self.context)

    @property
    def tokens(self) -> list[int]:
        return [token for output in self.outputs for token in output.token_ids]

    async def next(self) -> EngineOutput:
        output: EngineOutput = await anext(self._generate)
        self.outputs.append(output)
        self.times.append(time.monotonic())
        return output

    async def to_end(self) -> list[int]:
        async for output in self._generate:
            self.outputs.append(output)
            self.times.append(time.monotonic())
        return self.tokens

    async def close(self) -> None:
        await self._generate.aclose()


async def alone(engine: Any, token_ids: list[int], max_tokens: int, migrated_tokens: int = 0) -> list[int]:
    return await Stream(engine, token_ids, max_tokens, migrated_tokens=migrated_tokens).to_end()


async def test_concurrent_greedy_answers_are_each_the_answer_alone_and_stream_together(engine: Any) -> None:
    prompts = [chatml(engine, question) for question in QUESTIONS]
    by_itself = [await alone(engine, prompt, 40) for prompt in prompts]
    streams = [Stream(engine, prompt, 40) for prompt in prompts]
    # Started one after another, so each joins the others at a different point of their answers.
    runs = []
    for stream in streams:
        runs.append(asyncio.create_task(stream.to_end()))
        await asyncio.sleep(0.05)
    together = await asyncio.gather(*runs)
    assert together == by_itself
    # Decoded together, not in turn: the last request's first token came before the first one ended.
    assert streams[-1].times[0] < streams[0].times[-1]


async def test_a_cancelled_request_frees_its_slot_for_the_next_at_once(two_slots: Any) -> None:
    first = Stream(two_slots, chatml(two_slots, QUESTIONS[0]), 400)
    second = Stream(two_slots, chatml(two_slots, QUESTIONS[1]), 400)
    for _ in range(3):
        await first.next()
        await second.next()
    await first.close()
    assert first.context.stopped
    still_running = asyncio.create_task(second.to_end())  # its tokens timed as they arrive
    # Both slots were busy; the third request takes the first one's while the second still runs.
    third = Stream(two_slots, chatml(two_slots, QUESTIONS[2]), 5)
    assert len(await third.to_end()) == 5
    second.context.stop()
    await still_running
    # The second was stopped partway, after the third had its answer: they ran at the same time (one
    # request at a time, the third would have waited for all 400 of the second's tokens).
    assert len(second.outputs) < 400


async def test_each_slot_keeps_its_own_prefix_for_the_next_request(two_slots: Any) -> None:
    pirate = "You are a pirate who answers every question with a sea shanty. " * 6
    robot = "You are a robot that answers in binary and then explains the binary. " * 6
    firsts = [Stream(two_slots, chatml(two_slots, "Hello?", system), 4) for system in (pirate, robot)]
    await asyncio.gather(*(stream.to_end() for stream in firsts))
    # The next requests with either system prompt find it cached, each in the slot that kept it.
    for system in (pirate, robot):
        prompt = chatml(two_slots, "What is the time?", system)
        stream = Stream(two_slots, prompt, 2)
        await stream.to_end()
        cached = stream.outputs[0].cached_tokens
        assert cached is not None and len(chatml(two_slots, "", system)) - 8 <= cached < len(prompt)


async def test_a_request_waits_for_a_free_slot_when_all_are_busy(smollm2: Path) -> None:
    engine = await started_engine(smollm2, parallel=1)
    try:
        prompts = [chatml(engine, question) for question in QUESTIONS[:2]]
        by_itself = [await alone(engine, prompt, 12) for prompt in prompts]
        streams = [Stream(engine, prompt, 12) for prompt in prompts]
        assert await asyncio.gather(*(stream.to_end() for stream in streams)) == by_itself
        assert streams[1].times[0] > streams[0].times[-1]  # one slot: in turn
    finally:
        await engine.close()


async def test_a_migrated_request_among_others_continues_exactly_as_the_undisturbed_run(
    engine: Any, smollm2: Path
) -> None:
    prompt = chatml(engine, QUESTIONS[0])
    undisturbed = await alone(engine, prompt, 40)
    target = await started_engine(smollm2, parallel=4)
    try:
        others = [Stream(target, chatml(target, question), 60) for question in QUESTIONS[1:]]
        for stream in others:
            await stream.next()  # all three are generating when the migrated request arrives
        running = [asyncio.create_task(stream.to_end()) for stream in others]
        resumed = await alone(target, prompt + undisturbed[:13], 40 - 13, migrated_tokens=13)
        await asyncio.gather(*running)
    finally:
        await target.close()
    assert resumed == undisturbed[13:]


async def test_sampled_requests_with_the_same_seed_draw_the_same_tokens_together(engine: Any) -> None:
    prompt = chatml(engine, "Write a word.")
    streams = [Stream(engine, prompt, 12, temperature=1.0, seed=7) for _ in range(3)]
    tokens = await asyncio.gather(*(stream.to_end() for stream in streams))
    assert tokens[0] == tokens[1] == tokens[2]
