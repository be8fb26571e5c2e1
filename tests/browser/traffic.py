"""Completions sent through the gateway from a few threads, for as long as a ``with`` block lasts."""

import random
import threading
from types import TracebackType

import httpx

PREFIXES = [f"You are assistant number {number}. " + "Answer briefly and kindly. " * 40 for number in range(3)]


class Traffic:
    """``concurrency`` clients sending completions of ``model`` to ``api_url`` back to back.

    Prompts and lengths vary, so that the workers' KV-cache usage varies with them; every prompt starts
    with one of a few shared prefixes, as chats with a system prompt do, for the prefix caches to hit.
    ``answered`` counts the 200s; ``failures`` keeps what else came back (or what was raised), for the test's message.
    """

    def __init__(self, api_url: str, model: str, *, concurrency: int = 4) -> None:
        self.api_url = api_url
        self.model = model
        self.concurrency = concurrency
        self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "Traffic":
        self._threads = [
            threading.Thread(target=self._send, args=(number,), name=f"traffic-{number}", daemon=True)
            for number in range(self.concurrency)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _send(self, number: int) -> None:
        chooser = random.Random(number)
        with httpx.Client(base_url=self.api_url, timeout=30) as client:
            while not self._stop.is_set():
                words = " ".join(f"word{chooser.randrange(1000)}" for _ in range(chooser.randrange(10, 200)))
                prompt = PREFIXES[chooser.randrange(len(PREFIXES))] + words
                body = {"model": self.model, "prompt": prompt, "max_tokens": chooser.randrange(16, 256)}
                try:
                    reply = client.post("/completions", json=body)
                except httpx.HTTPError as exc:
                    self._failed(f"{type(exc).__name__}: {exc}")
                    continue
                if reply.status_code == 200:
                    with self._lock:
                        self.answered += 1
                else:
                    self._failed(f"HTTP {reply.status_code}: {reply.text[:200]}")

    def _failed(self, what: str) -> None:
        with self._lock:
            if len(self.failures) < 20:
                self.failures.append(what)
