"""A closed-loop HTTP load generator for streamed chat completions, light enough to share 2 cores.

Each of N keep-alive connections sends the same request back to back for a fixed time, reading the
chunked SSE answer to its end. It records requests and, per request, the time to the first body
chunk after the headers (the first SSE frame: the time to first token as a client sees it).
"""

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    requests: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def chat_request(port: int, model: str, prompt: str, max_tokens: int | None = None) -> bytes:
    """The raw bytes of a streamed chat-completion request (``max_tokens`` left out when None)."""
    fields: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    body = json.dumps(fields).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _connection(port: int, request: bytes, until: float, result: LoadResult) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < until:
            sent = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected answer: {head[:120]!r}")
            data = await reader.read(1 << 16)
            result.ttfts.append(time.perf_counter() - sent)
            # Chunked body: read until the terminating zero-length chunk.
            while not data.endswith(b"\r\n0\r\n\r\n"):
                chunk = await reader.read(1 << 16)
                if not chunk:
                    raise RuntimeError("connection closed mid-response")
                data += chunk
            if b"[DONE]" not in data:
                raise RuntimeError("stream ended without [DONE]")
            result.requests += 1
    finally:
        writer.close()


async def closed_loop(port: int, request: bytes, seconds: float, concurrency: int) -> LoadResult:
    """Drive the server at ``port`` for ``seconds`` with ``concurrency`` connections."""
    result = LoadResult()
    started = time.perf_counter()
    until = started + seconds
    await asyncio.gather(*(_connection(port, request, until, result) for _ in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result
