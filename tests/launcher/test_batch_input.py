"""``in=batch:FILE``: every prompt of a JSONL file answered into output.jsonl, in input order."""

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engines.echo import EchoFullEngine
from frontend_gateway.errors import InvalidRequest
from frontend_gateway.models.pipeline import Generation, TextModel
from frontend_gateway.openai_api.types import ChatCompletionRequest, CompletionRequest
from launcher.inputs.batch import BatchSummary, percentile, run_batch
from runtime.errors import ConfigError

FIELDS = ["text", "response", "tokens_in", "tokens_out", "elapsed_ms", "finish_reason"]


class EchoModel:
    """echo_full that refuses the prompt "boom" and keeps count of requests in flight."""

    def __init__(self) -> None:
        self.inner = TextModel("echo", EchoFullEngine(delay_seconds=0.0))
        self.name = self.inner.name
        self.created = self.inner.created
        self.context_length = self.inner.context_length
        self.requests: list[ChatCompletionRequest] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.finished: list[str] = []

    async def prepare_chat(self, request: ChatCompletionRequest) -> Generation:
        self.requests.append(request)
        prompt = request.messages[-1].content
        assert isinstance(prompt, str)
        if prompt == "boom":
            raise InvalidRequest("refused: boom")
        generation = await self.inner.prepare_chat(request)
        return generation.bind(self._counted(prompt, generation.pieces()))

    async def prepare_completion(self, request: CompletionRequest) -> Generation:
        raise AssertionError("in=batch sends chat requests only")

    async def _counted(self, prompt: str, pieces: AsyncIterator[str]) -> AsyncIterator[str]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.before_answering(prompt)
            async for piece in pieces:
                yield piece
        finally:
            self.in_flight -= 1
            self.finished.append(prompt)
            self.after_answering()

    async def before_answering(self, prompt: str) -> None:
        return None

    def after_answering(self) -> None:
        return None


class FirstPromptWaitsForTwoOthers(EchoModel):
    """The first prompt is answered only once two later ones have finished."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.first = first
        self.two_others_done = asyncio.Event()

    async def before_answering(self, prompt: str) -> None:
        if prompt == self.first:
            await self.two_others_done.wait()

    def after_answering(self) -> None:
        if len(self.finished) >= 2:
            self.two_others_done.set()


class AllWaitUntilThreeRun(EchoModel):
    """No prompt is answered before three requests have been in flight together."""

    def __init__(self) -> None:
        super().__init__()
        self.three_running = asyncio.Event()

    async def before_answering(self, prompt: str) -> None:
        if self.in_flight >= 3:
            self.three_running.set()
        await self.three_running.wait()


def write_input(folder: Path, lines: list[str], name: str = "prompts.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_output(summary: BatchSummary) -> list[dict[str, Any]]:
    lines = summary.output_path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def prompts(*texts: str) -> list[str]:
    return [json.dumps({"text": text}) for text in texts]


async def test_answers_are_written_beside_the_input_in_input_order_with_every_field(tmp_path: Path) -> None:
    input_path = write_input(tmp_path, prompts("hi", "héllo wörld", "a third prompt"))

    summary = await run_batch(EchoModel(), input_path, progress=False, stderr=io.StringIO())

    assert summary.output_path == tmp_path / "output.jsonl"
    records = read_output(summary)
    assert [list(record) for record in records] == [FIELDS] * 3
    for record in records:
        assert isinstance(record["elapsed_ms"], float)
        assert record["elapsed_ms"] >= 0
    assert [{k: v for k, v in record.items() if k != "elapsed_ms"} for record in records] == [
        {
            "text": text,
            "response": text,
            "tokens_in": len(text),
            "tokens_out": len(text),
            "finish_reason": "stop",
        }
        for text in ("hi", "héllo wörld", "a third prompt")
    ]
    assert "héllo wörld".encode() in summary.output_path.read_bytes()  # UTF-8, not \u escapes


async def test_each_prompt_is_sent_as_one_user_message_with_the_sampling_options(tmp_path: Path) -> None:
    model = EchoModel()
    input_path = write_input(tmp_path, prompts("abcdef"))

    summary = await run_batch(model, input_path, max_tokens=3, temperature=0.2, progress=False, stderr=io.StringIO())

    request = model.requests[0]
    assert [(message.role, message.content) for message in request.messages] == [("user", "abcdef")]
    assert (request.model, request.max_tokens, request.temperature) == ("echo", 3, 0.2)
    record = read_output(summary)[0]
    assert (record["response"], record["tokens_out"], record["finish_reason"]) == ("abc", 3, "length")


async def test_bad_lines_are_reported_with_their_numbers_and_skipped(tmp_path: Path) -> None:
    input_path = write_input(
        tmp_path,
        [
            '{"text": "first"}',
            "not json",
            "",
            '["text"]',
            '{"prompt": "x"}',
            '{"text": 5}',
            '{"text": "  "}',
            '{"text": "last"}',
        ],
    )
    stderr = io.StringIO()

    summary = await run_batch(EchoModel(), input_path, progress=False, stderr=stderr)

    reports = [line for line in stderr.getvalue().splitlines() if line.startswith("line ")]
    assert [report.split(":")[0] for report in reports] == ["line 2", "line 4", "line 5", "line 6", "line 7"]
    assert reports[0].startswith("line 2: invalid JSON (")
    assert reports[1:] == [
        "line 4: expected a JSON object, got array, skipped",
        'line 5: missing "text", skipped',
        'line 6: "text" must be a string, got number, skipped',
        'line 7: "text" is empty, skipped',
    ]
    assert all(report.endswith(", skipped") for report in reports)
    assert (summary.ok, summary.skipped) == (2, 5)
    assert [record["text"] for record in read_output(summary)] == ["first", "last"]


async def test_a_refused_request_is_reported_with_its_line_number_and_skipped(tmp_path: Path) -> None:
    input_path = write_input(tmp_path, prompts("one", "boom", "three"))
    stderr = io.StringIO()

    summary = await run_batch(EchoModel(), input_path, progress=False, stderr=stderr)

    assert "line 2: refused: boom, skipped\n" in stderr.getvalue()
    assert (summary.ok, summary.skipped) == (2, 1)
    assert [record["text"] for record in read_output(summary)] == ["one", "three"]


async def test_the_summary_adds_up_the_requests_that_succeeded(tmp_path: Path) -> None:
    texts = ("a", "bb", "cccc")
    input_path = write_input(tmp_path, [*prompts(*texts), "oops"])
    stderr = io.StringIO()

    summary = await run_batch(EchoModel(), input_path, progress=False, stderr=stderr)

    records = read_output(summary)
    assert (summary.ok, summary.skipped) == (3, 1)
    assert summary.tokens_in == sum(record["tokens_in"] for record in records) == 7
    assert summary.tokens_out == sum(record["tokens_out"] for record in records) == 7
    assert summary.elapsed_s > 0
    assert summary.tokens_per_s == pytest.approx(summary.tokens_out / summary.elapsed_s)
    latencies = sorted(record["elapsed_ms"] for record in records)
    assert latencies[0] <= summary.p50_ms <= summary.p90_ms <= summary.p99_ms <= latencies[-1]
    printed = stderr.getvalue()
    assert "requests: 3 ok, 1 skipped" in printed
    assert "tokens: 7 in, 7 out" in printed
    assert "output tokens/s" in printed
    assert "latency: p50 " in printed
    assert str(summary.output_path) in printed


async def test_answers_keep_input_order_when_later_requests_finish_first(tmp_path: Path) -> None:
    texts = ("slow", "two", "three", "four", "five")
    model = FirstPromptWaitsForTwoOthers(first="slow")
    input_path = write_input(tmp_path, prompts(*texts))

    async with asyncio.timeout(10):  # with one request at a time "slow" would wait forever
        summary = await run_batch(model, input_path, concurrency=3, progress=False, stderr=io.StringIO())

    assert model.finished[:2] == ["two", "three"]
    assert [record["text"] for record in read_output(summary)] == list(texts)


async def test_no_more_than_concurrency_requests_run_at_once(tmp_path: Path) -> None:
    model = AllWaitUntilThreeRun()
    input_path = write_input(tmp_path, prompts("1", "2", "3", "4", "5", "6", "7"))

    async with asyncio.timeout(10):  # fewer than three at a time would wait forever
        summary = await run_batch(model, input_path, concurrency=3, progress=False, stderr=io.StringIO())

    assert model.most_in_flight == 3
    assert summary.ok == 7


async def test_an_empty_input_writes_an_empty_output(tmp_path: Path) -> None:
    input_path = write_input(tmp_path, [])

    summary = await run_batch(EchoModel(), input_path, progress=False, stderr=io.StringIO())

    assert summary.output_path.read_bytes() == b""
    assert (summary.ok, summary.skipped, summary.tokens_out, summary.p99_ms) == (0, 0, 0, 0.0)


async def test_the_progress_bar_counts_requests_on_stderr(tmp_path: Path) -> None:
    input_path = write_input(tmp_path, prompts("one", "two"))
    stderr = io.StringIO()

    await run_batch(EchoModel(), input_path, progress=True, stderr=stderr)

    assert "2/2" in stderr.getvalue()


async def test_a_missing_input_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"

    with pytest.raises(ConfigError, match=r"nope\.jsonl"):
        await run_batch(EchoModel(), missing, progress=False, stderr=io.StringIO())


async def test_an_input_named_output_jsonl_is_refused_rather_than_overwritten(tmp_path: Path) -> None:
    input_path = write_input(tmp_path, prompts("keep me"), name="output.jsonl")

    with pytest.raises(ConfigError, match=r"output\.jsonl"):
        await run_batch(EchoModel(), input_path, progress=False, stderr=io.StringIO())
    assert "keep me" in input_path.read_text(encoding="utf-8")


async def test_concurrency_below_one_is_a_config_error(tmp_path: Path) -> None:
    input_path = write_input(tmp_path, prompts("x"))

    with pytest.raises(ConfigError, match="concurrency"):
        await run_batch(EchoModel(), input_path, concurrency=0, progress=False, stderr=io.StringIO())


def test_latency_percentiles_interpolate_between_samples() -> None:
    assert percentile([10.0, 20.0, 30.0, 40.0], 0.5) == 25.0
    assert percentile([10.0, 20.0, 30.0, 40.0], 0.9) == pytest.approx(37.0)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) == 0.0
