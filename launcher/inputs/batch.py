"""``in=batch:FILE``: answer every prompt of a JSONL file and report throughput and latency.

Each input line is ``{"text": "..."}``, sent as a one-message chat. Answers go to ``output.jsonl``
beside the input, in input order, however many requests run at once. Bad lines and refused
requests are reported on stderr with their line numbers and skipped.
"""

import asyncio
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, TextIO

import msgspec
from tqdm import tqdm

from frontend_gateway.errors import GatewayError
from frontend_gateway.models.pipeline import ServedModel
from frontend_gateway.openai_api.types import ChatCompletionRequest, ChatMessage
from runtime.errors import ConfigError

OUTPUT_NAME: Final = "output.jsonl"


@dataclass(frozen=True, kw_only=True)
class BatchSummary:
    """What a batch run did; latencies are over the requests that succeeded."""

    ok: int
    skipped: int
    tokens_in: int
    tokens_out: int
    elapsed_s: float
    tokens_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    output_path: Path


class _Record(msgspec.Struct):
    """One output line; the field order is the order written."""

    text: str
    response: str
    tokens_in: int
    tokens_out: int
    elapsed_ms: float
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class _Job:
    line: int
    text: str


async def run_batch(
    model: ServedModel,
    input_path: Path,
    *,
    concurrency: int = 4,
    max_tokens: int | None = None,
    temperature: float | None = None,
    progress: bool = True,
    stderr: TextIO = sys.stderr,
) -> BatchSummary:
    """Answer each prompt of ``input_path`` into ``output.jsonl`` beside it; print and return a summary.

    Raises ConfigError when the input cannot be read, would be overwritten by the output, or
    ``concurrency`` is below 1.
    """
    if concurrency < 1:
        raise ConfigError(f"batch concurrency must be at least 1, not {concurrency}")
    output_path = input_path.parent / OUTPUT_NAME
    data = await asyncio.to_thread(_read_input, input_path, output_path)

    jobs: list[_Job] = []
    skipped = 0
    for line_number, text_or_reason in _parse_lines(data):
        if isinstance(text_or_reason, _BadLine):
            print(f"line {line_number}: {text_or_reason.reason}, skipped", file=stderr)
            skipped += 1
        else:
            jobs.append(_Job(line_number, text_or_reason))

    runner = _Runner(model, max_tokens, temperature, stderr)
    started = time.perf_counter()
    with tqdm(total=len(jobs), unit="req", file=stderr, disable=not progress, desc="batch") as bar:
        records = await runner.run(jobs, output_path, concurrency, bar)
    elapsed_s = time.perf_counter() - started

    latencies = sorted(record.elapsed_ms for record in records)
    tokens_out = sum(record.tokens_out for record in records)
    summary = BatchSummary(
        ok=len(records),
        skipped=skipped + len(jobs) - len(records),
        tokens_in=sum(record.tokens_in for record in records),
        tokens_out=tokens_out,
        elapsed_s=elapsed_s,
        tokens_per_s=tokens_out / elapsed_s if elapsed_s > 0 else 0.0,
        p50_ms=percentile(latencies, 0.50),
        p90_ms=percentile(latencies, 0.90),
        p99_ms=percentile(latencies, 0.99),
        output_path=output_path,
    )
    print(format_summary(summary), file=stderr)
    return summary


def _read_input(input_path: Path, output_path: Path) -> bytes:
    try:
        data = input_path.read_bytes()
        overwrites_input = output_path.exists() and output_path.samefile(input_path)
    except OSError as exc:
        raise ConfigError(f"cannot read batch input {input_path}: {exc.strerror or exc}") from exc
    if overwrites_input:
        raise ConfigError(f"batch input {input_path} is named {OUTPUT_NAME}, where the answers go; rename it")
    return data


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ascending values, interpolating linearly; 0.0 when there are none."""
    if not sorted_values:
        return 0.0
    position = fraction * (len(sorted_values) - 1)
    below = int(position)
    above = min(below + 1, len(sorted_values) - 1)
    return sorted_values[below] + (sorted_values[above] - sorted_values[below]) * (position - below)


def format_summary(summary: BatchSummary) -> str:
    """The summary as printed at the end of a batch."""
    return (
        f"requests: {summary.ok} ok, {summary.skipped} skipped\n"
        f"tokens: {summary.tokens_in} in, {summary.tokens_out} out\n"
        f"time: {summary.elapsed_s:.2f} s, {summary.tokens_per_s:.1f} output tokens/s\n"
        f"latency: p50 {summary.p50_ms:.1f} ms, p90 {summary.p90_ms:.1f} ms, p99 {summary.p99_ms:.1f} ms\n"
        f"output: {summary.output_path}"
    )


@dataclass(frozen=True, slots=True)
class _BadLine:
    reason: str


_JSON_TYPES: Final = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
}


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _parse_lines(data: bytes) -> Iterator[tuple[int, str | _BadLine]]:
    """Each non-blank line's number (from 1) with its prompt, or why it cannot be used."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            value = msgspec.json.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            yield number, _BadLine(f"invalid JSON ({exc})")
            continue
        if not isinstance(value, dict):
            yield number, _BadLine(f"expected a JSON object, got {_json_type(value)}")
        elif "text" not in value:
            yield number, _BadLine('missing "text"')
        elif not isinstance(text := value["text"], str):
            yield number, _BadLine(f'"text" must be a string, got {_json_type(text)}')
        elif not text.strip():
            yield number, _BadLine('"text" is empty')
        else:
            yield number, text


class _Runner:
    """Runs the jobs ``concurrency`` at a time and writes their answers in input order."""

    def __init__(self, model: ServedModel, max_tokens: int | None, temperature: float | None, stderr: TextIO) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.stderr = stderr

    async def run(self, jobs: list[_Job], output_path: Path, concurrency: int, bar: Any) -> list[_Record]:
        """Answer ``jobs``; returns the records written, in order. Unexpected errors propagate."""
        try:
            output = await asyncio.to_thread(output_path.open, "wb")
        except OSError as exc:
            raise ConfigError(f"cannot write batch output {output_path}: {exc.strerror or exc}") from exc
        loop = asyncio.get_running_loop()
        answers: list[asyncio.Future[_Record | None]] = [loop.create_future() for _ in jobs]
        queue = iter(enumerate(jobs))  # shared: each worker takes the next job when it is free

        async def worker() -> None:
            for index, job in queue:
                try:
                    record = await self._answer(job)
                except Exception as exc:
                    answers[index].set_exception(exc)
                    return
                answers[index].set_result(record)
                bar.update(1)

        workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(jobs)))]
        try:
            return await self._write_in_order(answers, output)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.to_thread(output.close)

    async def _write_in_order(self, answers: list[asyncio.Future[_Record | None]], output: IO[bytes]) -> list[_Record]:
        written: list[_Record] = []
        encoder = msgspec.json.Encoder()
        index = 0
        while index < len(answers):
            await answers[index]
            # Write every answer that is ready in one go, stopping at the first one still running.
            chunk = bytearray()
            while index < len(answers) and answers[index].done():
                record = answers[index].result()
                index += 1
                if record is not None:
                    chunk += encoder.encode(record)
                    chunk += b"\n"
                    written.append(record)
            if chunk:
                await asyncio.to_thread(_write_and_flush, output, bytes(chunk))
        return written

    async def _answer(self, job: _Job) -> _Record | None:
        request = ChatCompletionRequest(
            model=self.model.name,
            messages=[ChatMessage(role="user", content=job.text)],
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
        started = time.perf_counter()
        try:
            generation = await self.model.prepare_chat(request)
            response = "".join([piece async for piece in generation.pieces()])
        except GatewayError as exc:
            tqdm.write(f"line {job.line}: {exc.message}, skipped", file=self.stderr)
            return None
        return _Record(
            text=job.text,
            response=response,
            tokens_in=generation.prompt_tokens,
            tokens_out=generation.completion_tokens,
            elapsed_ms=round((time.perf_counter() - started) * 1000.0, 3),
            finish_reason=generation.finish_reason,
        )


def _write_and_flush(output: IO[bytes], data: bytes) -> None:
    output.write(data)
    output.flush()
