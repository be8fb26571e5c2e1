"""llama.cpp's slots: concurrent requests decoded together in one context, as llama-server's are.

The context has ``n_seq`` sequences (slots), each with its own KV stream (llama.cpp's non-unified
cache: ``kv_unified`` false, ``n_ctx`` split evenly). One thread owns the context and runs a step loop.
Each step decodes a prompt chunk of the oldest request still reading its prompt, in a ``llama_decode``
of its own, then one token of every other request (its last sampled token, or its next migrated token)
in one ``llama_decode`` together, and samples each request whose logits came out with its own sampler
chain. Between steps it takes new requests, drops cancelled ones (their slot is free for the next
request at once) and runs other work (embeddings).

Prefix reuse per slot. A slot keeps the tokens its KV cells hold after its request ends (finished or
cancelled); a new request goes to the free slot whose tokens share the longest prefix with its prompt
(else the one unused the longest), and only the rest of the prompt is decoded.

Exactness. llama.cpp computes a sequence's attention with other CPU kernels when the micro-batch holds
one token of it than when it holds two or more, and the results round differently. With one KV stream
per sequence, a generating sequence has one token per step whatever the others do, so its attention is
computed as it would be alone; what else shares the micro-batch does not matter. A unified cache
computes the attention of all rows together instead, and its answers changed with the company
(SmolLM2 Q4_1, 4 prompts x 24 greedy tokens: 3 of 4 differed from the answer alone, against 0 of 4
with one stream each, started together or staggered). A prompt chunk is decoded in a call of its own:
llama.cpp splits a batch of several streams into micro-batches with as many tokens of each, so a chunk
mixed with generating rows would have its first token split off and decoded alone. And no chunk leaves
a single prompt token for the next one (``take_chunk``, ``plan_prefill``).

LoRA adapters. llama.cpp applies an adapter to the whole context (``llama_set_adapters_lora``), not to one
sequence, so a step decodes the requests of one adapter only (or of the base model): the running requests are
grouped by adapter, and the steps go to the groups in turn (``next_group``), the context's adapter set before
each. With requests of k adapters running, each advances once every k steps: a batch split by adapters. A slot's
cached tokens are reused only by a request of the adapter they were computed with.
"""

import collections
import concurrent.futures
import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.llamacpp.sampling import SequenceSampler, prompt_logprobs, token_logprob
from engines.llamacpp.vision import PlacedImage, WidenedPrompt
from runtime.engine import RequestContext
from runtime.errors import EngineError
from runtime.protocol import EngineOutput, PreprocessedRequest, TokenLogprob

log = logging.getLogger(__name__)

#: Put on a request's stream after its last output.
END = object()


@dataclass
class SequenceJob:
    """A request handed to the scheduler: ``emit`` puts outputs (EngineOutput, an EngineError, then
    END) on the request's stream from the engine thread."""

    request: PreprocessedRequest
    context: RequestContext
    emit: Callable[[object], None]
    grammar: Any = None
    #: The prompt with its images' placeholders widened to their rows (engines/llamacpp/vision.py); None: no images.
    widened: WidenedPrompt | None = None

    @property
    def lora(self) -> str | None:
        """The adapter the request runs with (None: the base model)."""
        return self.request.lora_name

    @property
    def prompt(self) -> list[int]:
        """The prompt's rows as the context holds them: token ids, and each image row as its image's key."""
        return self.widened.tokens if self.widened is not None else self.request.token_ids


@dataclass
class Slot:
    """One of the context's sequences: the tokens its KV cells hold, in position order."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    last_used: int = 0  # the step that last ended a request here (least recently used goes first)
    busy: bool = False
    lora: str | None = None  # the adapter its tokens' KV cells were computed with (None: the base model)


@dataclass
class _Running:
    """A request in a slot: what is left to decode, and what it has produced."""

    job: SequenceJob
    slot: Slot
    sampler: SequenceSampler
    eos_ids: frozenset[int]
    prompt: list[int]  # the prompt tokens still to decode in chunks
    singles: list[int]  # then these, one a step (migrated tokens at temperature 0)
    cached_tokens: int | None  # told on the first output, then None
    #: The prompt's rows, told on the first output when images made them more than its token ids; then None.
    prompt_rows: int | None = None
    images: Sequence[PlacedImage] = ()
    #: The prompt's log probabilities so far, when the request asks for them (told on the first output).
    prompt_logprobs: list[TokenLogprob] | None = None
    generated: int = 0
    next_token: int | None = None  # sampled, to be decoded in the next step


@dataclass(frozen=True)
class Admission:
    """Where a request goes: its slot, and how many of the slot's tokens it keeps."""

    slot: Slot
    reuse: int


def common_prefix(cached: Sequence[int], tokens: Sequence[int]) -> int:
    length = 0
    for have, want in zip(cached, tokens, strict=False):
        if have != want:
            break
        length += 1
    return length


def take_chunk(prompt: list[int], most: int) -> list[int]:
    """Take the next chunk of ``prompt`` off its front: at most ``most`` tokens, never leaving one alone
    for the next chunk (a lone token is decoded by other kernels than a chunk's)."""
    size = min(len(prompt), most)
    if len(prompt) - size == 1 and size > 2:
        size -= 1
    chunk = prompt[:size]
    del prompt[:size]
    return chunk


def take_run(prompt: list[int], most: int) -> list[int]:
    """``take_chunk``, cut where text meets an image's rows or one image's rows meet another's: a ``llama_decode``
    takes token ids or embeddings, not both, and an image's rows come from that image."""
    chunk = take_chunk(prompt, most)
    first = chunk[0]
    for index, row in enumerate(chunk):
        if (row < 0) != (first < 0) or (first < 0 and row != first):
            prompt[:0] = chunk[index:]
            return chunk[:index]
    return chunk


def choose_slot(slots: Sequence[Slot], prompt: Sequence[int], lora: str | None = None) -> Slot | None:
    """The free slot sharing the longest prefix with ``prompt`` computed with adapter ``lora`` (None: the base
    model); among equals the least recently used. None when every slot is busy."""
    free = [slot for slot in slots if not slot.busy]
    if not free:
        return None
    return max(free, key=lambda slot: (reusable(slot, prompt, lora), -slot.last_used))


def reusable(slot: Slot, prompt: Sequence[int], lora: str | None) -> int:
    """How many of ``slot``'s cached tokens a prompt of adapter ``lora`` may keep: none of another adapter's."""
    return common_prefix(slot.tokens, prompt) if slot.lora == lora else 0


def next_group(groups: Sequence[str | None], last: str | None, started: bool) -> str | None:
    """The adapter whose requests the next step decodes: among ``groups`` (the adapters of the running requests,
    the base model as None) in a fixed order (the base model first, then by name), the first after ``last``, round
    the end to the first; the first when no step ran yet (``started`` false)."""
    order = sorted(set(groups), key=_group_order)
    if not started:
        return order[0]
    later = [name for name in order if _group_order(name) > _group_order(last)]
    return later[0] if later else order[0]


def _group_order(name: str | None) -> tuple[bool, str]:
    return (name is not None, name or "")


class BatchScheduler:
    """The step loop over one llama.cpp context with ``n_seq`` sequences (slots), each in its own KV stream."""

    def __init__(self, model: Any, ctx: Any, *, n_seq: int, n_batch: int, plan: Callable[..., Any]) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self._model = model
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx.ctx)
        self._n_batch = n_batch
        self._plan = plan  # plan_prefill: the cached prefix to keep, the rest to decode
        self._n_vocab = model.n_vocab()
        self.slots = [Slot(seq_id) for seq_id in range(n_seq)]
        self._batch = llama_cpp.llama_batch_init(max(n_batch, n_seq), 0, 1)
        #: A batch of embeddings for images' rows, made by the first image (its width is the model's).
        self._embd_batch: Any = None
        self._embd_width = 0
        self._running: list[_Running] = []
        self._waiting: collections.deque[SequenceJob] = collections.deque()
        self._inbox: list[SequenceJob] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._wake = threading.Condition()
        self._closing = False
        self._step = 0
        #: Token rows decoded (for tests: how much of a prompt was evaluated).
        self.decoded_rows = 0
        #: The adapters loaded (engines/llamacpp/lora.py: name -> llama.cpp's adapter), and the one the context
        #: has set (None: none); the group of requests the last step decoded, and whether a step ran.
        self.adapters: dict[str, Any] = {}
        self._context_adapter: str | None = None
        self._last_group: str | None = None
        self._stepped = False
        #: Steps per adapter group (for tests: how the steps were shared).
        self.group_steps: collections.Counter[str | None] = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="llamacpp-steps", daemon=True)
        self._thread.start()

    # --- called from other threads -------------------------------------------------------------

    def submit(self, job: SequenceJob) -> None:
        with self._wake:
            self._inbox.append(job)
            self._wake.notify()

    def wake(self) -> None:
        """Look at the requests again now (one was cancelled)."""
        with self._wake:
            self._wake.notify()

    def call(self, function: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
        """Run ``function`` on the engine thread between two steps; its result or exception in the future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._wake:
            if self._closing:
                raise EngineError("the llama.cpp engine is closed")
            self._calls.append((function, future))
            self._wake.notify()
        return future

    def close(self) -> None:
        """Stop the loop (requests in flight end with an error) and wait for the thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        self._llama_cpp.llama_batch_free(self._batch)
        if self._embd_batch is not None:
            self._llama_cpp.llama_batch_free(self._embd_batch)

    # --- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._calls or self._closing or self._has_work()):
                    self._wake.wait()
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                calls, self._calls = self._calls, []
                closing = self._closing
            for function, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(function())
                    except BaseException as exc:  # handed to the caller, who re-raises it
                        future.set_exception(exc)
            if closing:
                self._fail_all(EngineError("the llama.cpp engine was closed"))
                return
            self._drop_cancelled()
            self._admit()
            if self._running:
                try:
                    self._decode_step()
                except Exception as exc:
                    log.exception("llama.cpp failed a decoding step")
                    self._fail_all(EngineError(f"llama.cpp failed: {exc}"))

    def _has_work(self) -> bool:
        return bool(self._running) or bool(self._waiting)

    def _drop_cancelled(self) -> None:
        for running in [r for r in self._running if r.job.context.stopped]:
            self._finish(running)
        for job in [j for j in self._waiting if j.context.stopped]:
            self._waiting.remove(job)
            job.emit(END)

    def _admit(self) -> None:
        while self._waiting:
            job = self._waiting[0]
            if job.lora is not None and job.lora not in self.adapters:
                # Unloaded while the request waited for a slot.
                self._waiting.popleft()
                self._refuse(job, EngineError(f"adapter {job.lora!r} is not loaded on this llama.cpp worker"))
                continue
            slot = choose_slot(self.slots, job.prompt, job.lora)
            if slot is None:
                return
            self._waiting.popleft()
            try:
                self._running.append(self._start(job, slot))
            except Exception as exc:
                log.exception("llama.cpp could not start request %s", job.request.request_id)
                job.emit(EngineOutput([], "error"))
                job.emit(EngineError(f"llama.cpp failed: {exc}"))
                job.emit(END)

    def _start(self, job: SequenceJob, slot: Slot) -> _Running:
        request = job.request
        sampler = SequenceSampler(self._model, request, job.grammar)
        try:
            # Only greedy decoding can continue exactly; a sampled continuation gains nothing from the
            # slower one-a-step decoding of the migrated tokens.
            one_at_a_time = request.migrated_tokens if sampler.greedy else 0
            # Cells computed with another adapter (or without one) are no prefix of this request's.
            cached = slot.tokens if slot.lora == job.lora else []
            if request.prompt_logprobs is not None:
                # Every prompt position's logits are needed, and a cached prefix kept none: the whole prompt is
                # decoded, in chunks (the gateway sends no migrated tokens with it).
                one_at_a_time, cached = 0, []
            plan = self._plan(cached, job.prompt, one_at_a_time, self._n_batch)
            reuse = plan.reuse
            if not self._llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, reuse, -1):
                # A context that cannot drop a suffix (recurrent models) starts the slot afresh.
                self._llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
                reuse = 0
            del slot.tokens[reuse:]
            slot.lora = job.lora
        except BaseException:
            sampler.close()
            raise
        slot.busy = True
        prompt = job.prompt
        split = len(prompt) - one_at_a_time
        return _Running(
            job=job,
            slot=slot,
            sampler=sampler,
            eos_ids=frozenset(request.eos_token_ids) | {self._model.token_eos()},
            prompt=list(prompt[reuse:split]),
            singles=list(prompt[split:]),
            cached_tokens=reuse,
            prompt_rows=len(prompt) if job.widened is not None else None,
            images=job.widened.images if job.widened is not None else (),
            prompt_logprobs=[] if request.prompt_logprobs is not None else None,
        )

    def _decode_step(self) -> None:
        """One step for the requests of one adapter (``next_group``), with the context's adapter set to it: a
        prompt chunk of the oldest of them still reading its prompt, in a call of its own; then one row for each
        other (its last sampled token or its next migrated one), together."""
        group = next_group([running.job.lora for running in self._running], self._last_group, self._stepped)
        self._last_group, self._stepped = group, True
        self.group_steps[group] += 1
        self._use_adapter(group)
        members = [running for running in self._running if running.job.lora == group]
        reading = next((running for running in members if running.prompt), None)
        if reading is not None:
            chunk = take_run(reading.prompt, self._n_batch)
            if chunk[0] < 0:
                self._decode_image_rows(reading, chunk)
            else:
                self._decode([(reading, chunk)], every_row=reading.prompt_logprobs)
        rows = []
        for running in members:
            if running.next_token is not None:
                rows.append((running, [running.next_token]))
                running.next_token = None
            elif not running.prompt and running.singles and running is not reading:
                rows.append((running, [running.singles.pop(0)]))
        if rows:
            self._decode(rows)

    def _decode(self, parts: list[tuple[_Running, list[int]]], *, every_row: list[TokenLogprob] | None = None) -> None:
        """Decode each request's tokens after what its slot holds, in one ``llama_decode``, and sample
        each request whose tokens end what it had to read. ``every_row``: the one part is a prompt chunk
        whose tokens' log probabilities are asked; the logits of every row are kept, and the log
        probabilities of the prompt tokens they predict are added to it."""
        batch = self._batch
        rows = 0
        sampled = []
        start = 0
        for running, tokens in parts:
            slot = running.slot
            done = not running.prompt and not running.singles
            start = len(slot.tokens)
            for offset, token in enumerate(tokens):
                batch.token[rows] = token
                batch.pos[rows] = start + offset
                batch.n_seq_id[rows] = 1
                batch.seq_id[rows][0] = slot.seq_id
                batch.logits[rows] = every_row is not None or (done and offset == len(tokens) - 1)
                rows += 1
            slot.tokens.extend(tokens)
            if done:
                sampled.append((running, rows - 1))
        batch.n_tokens = rows
        status = self._llama_cpp.llama_decode(self._ctx.ctx, batch)
        if status != 0:
            raise EngineError(f"llama_decode returned {status} (the KV cache is full, or the batch is bad)")
        self.decoded_rows += rows
        if every_row is not None:
            every_row.extend(self._prompt_logprobs(parts[0][0].job.request, start, rows))
        for running, row in sampled:
            self._sample(running, row)

    def _decode_image_rows(self, running: _Running, chunk: list[int]) -> None:
        """Decode the next rows of one image (its embeddings; ``chunk`` their keys) after what the request's slot
        holds, in a ``llama_decode`` of their own."""
        import numpy as np

        count = len(chunk)
        slot = running.slot
        start = len(slot.tokens)
        image = next((image for image in running.images if image.first <= start < image.end), None)
        if image is None or start + count > image.end:
            raise EngineError(f"no image rows are known at prompt position {start}")
        rows = np.ascontiguousarray(image.rows[start - image.first : start - image.first + count], dtype=np.float32)
        width = rows.shape[1]
        if self._embd_batch is None or self._embd_width != width:
            if self._embd_batch is not None:
                self._llama_cpp.llama_batch_free(self._embd_batch)
            self._embd_batch = self._llama_cpp.llama_batch_init(self._n_batch, width, 1)
            self._embd_width = width
        batch = self._embd_batch
        ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
        done = not running.prompt and not running.singles
        for offset in range(count):
            batch.pos[offset] = start + offset
            batch.n_seq_id[offset] = 1
            batch.seq_id[offset][0] = slot.seq_id
            batch.logits[offset] = done and offset == count - 1
        batch.n_tokens = count
        slot.tokens.extend(chunk)
        status = self._llama_cpp.llama_decode(self._ctx.ctx, batch)
        if status != 0:
            raise EngineError(f"llama_decode returned {status} for an image's rows (the KV cache is full?)")
        self.decoded_rows += count
        if done:
            self._sample(running, count - 1)

    def _prompt_logprobs(self, request: PreprocessedRequest, start: int, rows: int) -> list[TokenLogprob]:
        """The log probabilities of the prompt tokens that the ``rows`` just decoded (the prompt's from
        position ``start``) predict: row ``i`` the token at ``start + i + 1``, while it is in the prompt."""
        import numpy as np

        token_ids = request.token_ids
        count = min(rows, len(token_ids) - start - 1)
        if count <= 0:
            return []
        n_vocab = self._n_vocab
        matrix = np.empty((count, n_vocab), dtype=np.float32)
        for row in range(count):
            matrix[row] = np.ctypeslib.as_array(self._ctx.get_logits_ith(row), shape=(n_vocab,))
        targets = list(token_ids[start + 1 : start + 1 + count])
        return prompt_logprobs(matrix, targets, request.prompt_logprobs or 0)

    def _sample(self, running: _Running, row: int) -> None:
        request = running.job.request
        stop = request.stop_conditions
        token = running.sampler.sample(self._ctx, row)
        cached, running.cached_tokens = running.cached_tokens, None
        prompt, running.prompt_logprobs = running.prompt_logprobs, None
        rows, running.prompt_rows = running.prompt_rows, None
        if token in running.eos_ids and not stop.ignore_eos:
            running.job.emit(EngineOutput([], "stop", cached, prompt_logprobs=prompt, prompt_tokens=rows))
            self._finish(running)
            return
        running.generated += 1
        logprobs = None
        if request.logprobs is not None:
            logits = self._ctx.get_logits_ith(row)
            logprobs = [token_logprob(logits, self._n_vocab, token, request.logprobs)]
        if running.generated >= stop.max_tokens:
            running.job.emit(
                EngineOutput([token], "length", cached, logprobs, prompt_logprobs=prompt, prompt_tokens=rows)
            )
            self._finish(running)
            return
        running.job.emit(EngineOutput([token], None, cached, logprobs, prompt_logprobs=prompt, prompt_tokens=rows))
        running.next_token = token

    def _finish(self, running: _Running) -> None:
        """End a request: its slot is free at once and keeps the tokens it decoded, for the next prompt."""
        self._running.remove(running)
        running.sampler.close()
        running.slot.busy = False
        running.slot.last_used = self._step = self._step + 1
        running.job.emit(END)

    def _use_adapter(self, name: str | None) -> None:
        """Set the context's adapter to ``name`` (None: none), where it is not already."""
        if name == self._context_adapter:
            return
        llama_cpp = self._llama_cpp
        if name is None:
            status = llama_cpp.llama_set_adapters_lora(self._ctx.ctx, None, 0, None)
        else:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self.adapters[name])
            scales = (ctypes.c_float * 1)(1.0)
            status = llama_cpp.llama_set_adapters_lora(self._ctx.ctx, adapters, 1, scales)
        if status != 0:
            raise EngineError(f"llama.cpp could not set adapter {name!r} on its context ({status})")
        self._context_adapter = name

    def drop_adapter(self, name: str) -> Any:
        """On the engine thread: end the requests of adapter ``name`` with an error, forget the slots' cells it
        computed, take it off the context, and return llama.cpp's adapter (for the caller to free), or None."""
        error = EngineError(f"adapter {name!r} was unloaded from this llama.cpp worker")
        for running in [running for running in self._running if running.job.lora == name]:
            running.job.emit(EngineOutput([], "error"))
            running.job.emit(error)
            self._finish(running)
        for job in [job for job in self._waiting if job.lora == name]:
            self._waiting.remove(job)
            self._refuse(job, error)
        for slot in self.slots:
            if slot.lora == name:
                self._llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
                slot.tokens.clear()
                slot.lora = None
        if self._context_adapter == name:
            self._use_adapter(None)
        return self.adapters.pop(name, None)

    @staticmethod
    def _refuse(job: SequenceJob, error: EngineError) -> None:
        job.emit(EngineOutput([], "error"))
        job.emit(error)
        job.emit(END)

    def _fail_all(self, error: EngineError) -> None:
        for running in list(self._running):
            running.job.emit(EngineOutput([], "error"))
            running.job.emit(error)
            self._finish(running)
            # What its cells hold is not known after a failed decode: forget the slot's cache.
            self._llama_cpp.llama_memory_seq_rm(self._memory, running.slot.seq_id, -1, -1)
            running.slot.tokens.clear()
        while self._waiting:
            job = self._waiting.popleft()
            job.emit(EngineOutput([], "error"))
            job.emit(error)
            job.emit(END)
