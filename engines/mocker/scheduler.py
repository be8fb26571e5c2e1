"""The scheduler of one simulated dp rank, after vLLM's: which sequences compute what in a step.

Each step has a budget of ``max_num_batched_tokens`` tokens. Running sequences come first, in the
order they were admitted: one that decodes computes one token; one still prefilling computes what
is left of its prompt, or a chunk of it that fits the budget. Then, if no sequence had to be
preempted, waiting sequences are admitted in arrival order while the budget, ``max_num_seqs`` and
the KV cache allow; an admitted sequence starts after its longest cached prefix (at most all of its
tokens but the last, as in vLLM), and that prefix is its ``cached_tokens`` (counted in the prefix
hit rate at its first admission). With ``enable_chunked_prefill`` off, a prompt is admitted only in
a step with room for all of it.

``scheduler`` picks whose admission and block manager are simulated:

* "v1" (the default; vLLM v1's ``Scheduler.schedule`` and ``KVCacheManager.allocate_slots``, as
  Dynamo 1.6.1's mocker simulates them): a waiting sequence is admitted when the blocks of all its
  tokens so far would fit, though it is given only those of the chunk it computes in this step; the
  next chunks take their blocks step by step like a running sequence's tokens. No watermark. Each
  block is the sequence's own (kv_cache_v1.py): two sequences that compute the same block both hold
  a copy.
* "v0" (vLLM v0's block manager): a waiting sequence is admitted only when all the blocks of its
  prompt fit, less a watermark kept for the running ones; a block computed again under a name
  already cached is merged into the cached one (kv_cache_v0.py).

When a running sequence needs a block and none is left, another running sequence is preempted
(the newest, or the oldest with ``preemption_mode`` "fifo"): its blocks are freed, and it goes
back to the front of the waiting queue to be recomputed — its prompt and the tokens it generated,
much of which the prefix cache usually still holds.

A block is named (cached, shareable, and recorded for a KV event) when the step that computes its
last tokens is scheduled, not once the step is over: vLLM v1's ``allocate_slots`` caches the blocks
up to ``num_computed_tokens + num_new_tokens`` as it schedules them, so a sequence admitted in the
same step or later hits them. The engine publishes the step's KV events once its pass is over, as
Dynamo's mocker does (engine.py). Blocks of running sequences are named after the preemptions of the
step are settled, so that a sequence preempted in the step leaves no block it never computed.

A sequence produces a token in the step in which it has computed all of its tokens: the step
that ends its prefill, then every step after (decode). The token ids are pseudo-random from the
vocabulary, seeded by the request, never an end-of-sequence id; a sequence ends at ``max_tokens``.
``schedule()`` plans a step and ``complete()`` applies it once its simulated time has passed.

With ``num_host_blocks`` (v1 only), the rank has a host-memory tier (host_tier.py): the prompt blocks a
step computes are copied there from the next step on, a waiting sequence whose prefix left the device but is
on the host takes it back (it waits, holding its blocks, in ``loading`` until the copy ends, then goes back
to the front of the queue with that prefix computed), and ``schedule(now)`` is given the rank's simulated
clock so that copies end in simulated time.
"""

from collections import deque
from collections.abc import Sequence as Tokens
from typing import Any, Protocol

from engines.mocker.config import MockerConfig, host_bandwidths
from engines.mocker.host_tier import HostTier, block_seconds
from engines.mocker.kv_cache_base import KvCacheBase, SequenceBlocks
from engines.mocker.kv_cache_v0 import KvCacheV0
from engines.mocker.kv_cache_v1 import KvCacheV1
from runtime.errors import EngineError
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockRemoved, BlockStored, KvEvent
from runtime.lora import lora_root_hash
from runtime.protocol import FinishReason

_MASK64 = (1 << 64) - 1
# The LCG of Knuth's MMIX: cheap, and good enough to look like text to a benchmark.
_LCG_MULTIPLIER, _LCG_INCREMENT = 6364136223846793005, 1442695040888963407
#: The watermark of ``scheduler`` "v0" when none is given (vLLM v0's default).
V0_WATERMARK = 0.01
#: Admissions over which the prefix hit rate is reported.
HIT_RATE_WINDOW = 1000


class StopFlag(Protocol):
    """What a sequence polls to learn that its client went away (a RequestContext)."""

    stopped: bool


class Sequence:
    """One request on one rank: its tokens, its blocks, and what it has produced for its consumer."""

    __slots__ = (
        "block_hashes",
        "blocks",
        "cached_tokens",
        "done",
        "eos",
        "error",
        "finish_reason",
        "host_load",
        "host_offered",
        "lora_id",
        "lora_root",
        "max_tokens",
        "num_computed",
        "num_tokens",
        "outbox",
        "output",
        "prefilling",
        "prompt",
        "request_id",
        "rng",
        "stop",
        "transferred",
        "vocab_size",
        "waiter",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Tokens[int],
        max_tokens: int,
        *,
        seed: int,
        vocab_size: int,
        stop: StopFlag,
        eos_token_ids: Tokens[int] = (),
        lora_id: int | None = None,
    ) -> None:
        self.request_id = request_id
        #: The LoRA adapter it runs with (``lora_id(name)``), and where its block chain starts
        #: (runtime/lora.py ``lora_root_hash``): its blocks are never those of another adapter or the base model.
        self.lora_id = lora_id
        self.lora_root = lora_root_hash(lora_id)
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output: list[int] = []
        #: len(prompt) + len(output), kept as a plain attribute: the scheduler reads it every step.
        self.num_tokens = len(prompt)
        #: Sequence hashes of the full blocks known so far (filled when prefix caching is on).
        self.block_hashes: list[int] = []
        self.blocks = SequenceBlocks()
        self.num_computed = 0
        self.prefilling = True
        #: Prompt tokens found cached when first admitted; None until then.
        self.cached_tokens: int | None = None
        self.rng = seed & _MASK64
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.stop = stop
        #: Tokens produced and not yet taken by the consumer.
        self.outbox: list[int] = []
        #: The consumer's wake-up, owned by the engine (the scheduler never touches it).
        self.waiter: Any = None
        self.done = False
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        #: Its prompt's KV came computed from a prefill worker (a handoff): the prompt takes blocks and
        #: budget, but no prefill time. False again once preempted: the prompt is then recomputed here.
        self.transferred = False
        #: The host tier's copy bringing its prefix back while it waits in ``Scheduler.loading``; else None.
        self.host_load: int | None = None
        #: Its leading prompt blocks already offered to the host tier (the next cohort starts there).
        self.host_offered = 0

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start`` to ``end`` of prompt + output."""
        prompt = self.prompt
        split = len(prompt)
        if end <= split:
            return list(prompt[start:end])
        if start >= split:
            return self.output[start - split : end - split]
        return [*prompt[start:], *self.output[: end - split]]

    def next_token(self) -> int:
        """The next pseudo-random token id: never one of the end-of-sequence ids."""
        state = (self.rng * _LCG_MULTIPLIER + _LCG_INCREMENT) & _MASK64
        self.rng = state
        token = (state >> 33) % self.vocab_size
        if self.eos:
            # Walk to the next id that is not an end; bounded: the vocabulary is larger than the ends.
            while token in self.eos:
                token = (token + 1) % self.vocab_size
        return token


class Step:
    """What one step computes: tokens per sequence, and what ended before it ran."""

    __slots__ = ("dropped", "scheduled")

    def __init__(self) -> None:
        #: Sequence -> tokens it computes in this step, in scheduling order.
        self.scheduled: dict[Sequence, int] = {}
        #: Sequences that ended while being scheduled (stopped by their client, or unable ever to fit).
        self.dropped: list[Sequence] = []

    def prefill_tokens(self) -> int:
        """The new prompt tokens this step's prefill is timed by (timing.py), counted as Dynamo's mocker counts
        them: n, the sequences that compute prompt tokens in the step, times the integer mean of their prompt
        lengths so far less the integer mean of what they had computed before (their sum, give or take n - 1).
        Output tokens recomputed after a preemption are not prompt tokens: they take budget, not prefill time;
        nor is a prompt whose KV a prefill worker handed over (``Sequence.transferred``).

        Read before ``Scheduler.complete`` applies the step (it moves what the sequences have computed).
        """
        count = total_after = total_before = 0
        for sequence, tokens in self.scheduled.items():
            prompt = len(sequence.prompt)
            before = sequence.num_computed
            if before < prompt and not sequence.transferred:
                count += 1
                total_after += min(before + tokens, prompt)
                total_before += before
        return count * (total_after // count - total_before // count) if count else 0

    def decode_tokens(self) -> int:
        """The summed lengths (prompt and output so far) of the sequences that decode in this step: what its
        decode pass is timed by (timing.py); 0 when none does.

        A sequence whose prefill ends in the step gets its first token from that prefill's forward pass, as
        Dynamo 1.6.1's mocker times it: it is not in the step's decode batch.
        """
        return sum(sequence.num_tokens for sequence in self.scheduled if not sequence.prefilling)


class PrefixStats:
    """Prompt tokens found cached, over the last ``HIT_RATE_WINDOW`` admissions and in total."""

    __slots__ = ("_window", "_window_cached", "_window_prompt", "cached_tokens", "prompt_tokens")

    def __init__(self) -> None:
        self._window: deque[tuple[int, int]] = deque()
        self._window_prompt = 0
        self._window_cached = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self._window.append((prompt_tokens, cached_tokens))
        self._window_prompt += prompt_tokens
        self._window_cached += cached_tokens
        if len(self._window) > HIT_RATE_WINDOW:
            old_prompt, old_cached = self._window.popleft()
            self._window_prompt -= old_prompt
            self._window_cached -= old_cached

    @property
    def hit_rate(self) -> float | None:
        """Cached over prompt tokens in the window; None before any admission."""
        if not self._window_prompt:
            return None
        return self._window_cached / self._window_prompt


class Scheduler:
    """Waiting and running sequences of one rank, and its KV cache."""

    def __init__(self, config: MockerConfig) -> None:
        """Raises ValueError for a host tier (``num_host_blocks``) under ``scheduler`` "v0"."""
        self.config = config
        self.cache: KvCacheBase
        if config.scheduler == "v1":
            self.cache = KvCacheV1(
                config.num_gpu_blocks, config.block_size, prefix_caching=config.enable_prefix_caching
            )
        else:
            self.cache = KvCacheV0(
                config.num_gpu_blocks,
                config.block_size,
                prefix_caching=config.enable_prefix_caching,
                watermark=V0_WATERMARK if config.watermark is None else config.watermark,
            )
        self._v1 = config.scheduler == "v1"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        #: Sequences holding their blocks while the host tier copies their prefix back (v1 with a host tier).
        self.loading: list[Sequence] = []
        #: The rank's simulated clock (seconds): where the host tier's copies are timed. ``schedule(now)``
        #: moves it; it never goes back.
        self.clock = 0.0
        self.stats = PrefixStats()
        #: Prompt tokens brought back from the host tier (not found on the device) at first admission.
        self.host_stats = PrefixStats()
        self.host: HostTier | None = None
        # Cohorts the host tier had no room for yet, offered again at the next step.
        self._host_retry: list[tuple[Sequence, list[tuple[int, int | None]]]] = []
        if config.num_host_blocks is not None:
            if not self._v1:
                raise ValueError('a host tier (num_host_blocks) is simulated with "scheduler": "v1" only')
            d2h, h2d = host_bandwidths(config)
            block_bytes = config.block_size * (config.kv_bytes_per_token or 0)
            self.host = HostTier(
                config.num_host_blocks,
                d2h_block_seconds=block_seconds(block_bytes, d2h, config.speedup_ratio),
                h2d_block_seconds=block_seconds(block_bytes, h2d, config.speedup_ratio),
            )
            self.cache.announce_all_cleared = False
        self.generated_tokens = 0  # output tokens produced since start, for the load reports
        self.preemptions = 0
        self._lifo = config.preemption_mode == "lifo"
        # Block hash -> the adapter (lora_id) it was computed with, oldest first: what the KV events say of it.
        self._lora_blocks: dict[int, int] = {}
        self._lora_blocks_kept = 2 * (config.num_gpu_blocks + (config.num_host_blocks or 0))

    @property
    def has_work(self) -> bool:
        """Whether a step has something to do: sequences to run, or host copies to start or wait for."""
        return bool(self.running or self.waiting or self.loading or (self.host is not None and self.host.busy))

    def idle_seconds(self) -> float:
        """How long a step that schedules nothing lasts: until the next host copy ends (0: none under way)."""
        deadline = None if self.host is None else self.host.next_deadline()
        return 0.0 if deadline is None else max(0.0, deadline - self.clock)

    def take_events(self) -> list[KvEvent]:
        """The KV events of the device, then of the host tier, since the last call."""
        events = self.cache.take_events()
        if self.host is not None and (host_events := self.host.take_events()):
            events = [*events, *host_events]
        return self._tag_lora(events)

    def set_record_events(self, on: bool) -> None:
        """Record KV events (for a sink) in the device cache and the host tier."""
        self.cache.record_events = on
        if self.host is not None:
            self.host.record_events = on

    def cache_state(self) -> list[BlockStored]:
        """Every cached block of the device, then of the host tier (``medium="cpu"``), parents first."""
        state = self.cache.cache_state()
        if self.host is not None:
            state.extend(self.host.cache_state())
        if self._lora_blocks:
            for event in state:
                event.lora_id = self._lora_blocks.get(event.block_hashes[0])
        return state

    def add(self, sequence: Sequence) -> None:
        """Queue ``sequence``. Raises EngineError for a prompt this rank could never schedule."""
        config = self.config
        prompt_tokens = len(sequence.prompt)
        if prompt_tokens == 0:
            raise EngineError("the mocker needs a prompt of at least one token")
        blocks = -(-prompt_tokens // config.block_size)
        if blocks > self.cache.admission_limit:
            raise EngineError(
                f"a prompt of {prompt_tokens} tokens needs {blocks} KV blocks of {config.block_size} tokens; "
                f"a request may use {self.cache.admission_limit} (num_gpu_blocks {config.num_gpu_blocks}"
                f"{'' if self._v1 else ' less the watermark'})"
            )
        if not config.enable_chunked_prefill and prompt_tokens > config.max_num_batched_tokens:
            raise EngineError(
                f"a prompt of {prompt_tokens} tokens is longer than max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) and enable_chunked_prefill is off"
            )
        if config.enable_prefix_caching:
            sequence.block_hashes = sequence_block_hashes(sequence.prompt, config.block_size, sequence.lora_root)
            self._note_lora(sequence, sequence.block_hashes)
        sequence.blocks = self.cache.new_table()
        self.waiting.append(sequence)

    def abort(self, sequence: Sequence) -> None:
        """End ``sequence`` now (its client is gone) and free its blocks at once."""
        if sequence.done:
            return
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        elif sequence.host_load is not None:
            self._cancel_load(sequence)
        else:
            self.running.remove(sequence)
        self._finish(sequence, "cancelled")

    def fail_all(self, message: str) -> list[Sequence]:
        """End every sequence with ``message`` as its error (the step loop died); returns them."""
        failed = [*self.running, *self.waiting, *self.loading]
        for sequence in list(self.loading):
            self._cancel_load(sequence)
        self.running.clear()
        self.waiting.clear()
        for sequence in failed:
            sequence.done = True
            sequence.error = message
        return failed

    # -- one step ----------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> Step:
        """Plan the next step, starting at simulated time ``now`` (None: the clock as it is): tokens per
        sequence, preempting and admitting as vLLM v1 does."""
        if now is not None and now > self.clock:
            self.clock = now
        if self.host is not None:
            self._host_tick()
        step = Step()
        scheduled = step.scheduled
        cache = self.cache
        running = self.running
        budget = self.config.max_num_batched_tokens
        block_size = self.config.block_size
        preempted = False
        index = 0
        while index < len(running):
            sequence = running[index]
            if sequence.stop.stopped:
                running.pop(index)
                self._finish(sequence, "cancelled")
                step.dropped.append(sequence)
                continue
            if budget == 0:
                index += 1
                continue
            computed = sequence.num_computed
            tokens = sequence.num_tokens - computed
            if tokens > budget:
                tokens = budget
            # Most steps stay inside the blocks a sequence has: only a crossing asks the cache.
            while computed + tokens > sequence.blocks.count * block_size and not cache.allocate(
                sequence.blocks, computed + tokens
            ):
                victim = running.pop() if self._lifo else running.pop(0)
                if victim is not sequence and not self._lifo:
                    index -= 1  # the oldest went from before this one
                    budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is sequence:
                    break
            else:
                scheduled[sequence] = tokens
                budget -= tokens
                index += 1
        if self.config.enable_prefix_caching:
            for sequence, tokens in scheduled.items():
                self._commit(sequence, sequence.num_computed + tokens)
        if not preempted:
            budget = self._admit(step, budget)
        if self.host is not None:
            self._offer_to_host(step)
        return step

    def _admit(self, step: Step, budget: int) -> int:
        config = self.config
        block_size = config.block_size
        cache = self.cache
        host = self.host
        waiting, running = self.waiting, self.running
        index = 0  # sequences before it wait for a host copy to land: the others are still admitted
        while index < len(waiting) and budget > 0 and len(running) < config.max_num_seqs:
            sequence = waiting[index]
            if sequence.stop.stopped:
                del waiting[index]
                self._finish(sequence, "cancelled")
                step.dropped.append(sequence)
                continue
            total = sequence.num_tokens
            if -(-total // block_size) > cache.admission_limit:
                # It could never hold all its tokens, whatever ends: a preempted sequence outgrew the cache.
                del waiting[index]
                self._fail_outgrown(step, sequence)
                continue
            loaded = sequence.blocks.count
            if loaded:
                # Its prefix came back from the host tier: it holds those blocks, computed.
                hit, idle_hit = loaded, 0
                cached = sequence.num_computed
            else:
                # vLLM computes at least the last token, even when the whole prompt is cached.
                limit = (total - 1) // block_size
                hit, idle_hit = cache.prefix_hit(sequence.block_hashes, limit)
                cached = hit * block_size
                if host is not None and not sequence.transferred:
                    on_host, pending = host.lookup(sequence.block_hashes, hit, limit)
                    if pending:
                        index += 1  # part of its prefix is still being copied to the host: look again later
                        continue
                    if on_host:
                        if not self._load(sequence, hit, idle_hit, on_host):
                            break  # no room for it yet: as when blocks run out, the ones behind it wait too
                        del waiting[index]
                        continue
            tokens = total - cached
            if tokens > budget:
                if not config.enable_chunked_prefill:
                    break  # first come, first served: the ones behind it wait too (v0 and v1 alike)
                tokens = budget
            # Admitted once the blocks of all its tokens so far fit (beside v0's watermark), as Dynamo's
            # mocker admits, though it computes only this step's chunk now; its cached blocks that no
            # one holds count too, since reviving them takes room.
            more_blocks = -(-total // block_size) - hit + idle_hit
            if not cache.can_admit(more_blocks + self._loading_reserve()):
                if not running and not self.loading:
                    # Nothing will ever free a block for it: a preempted sequence outgrew the cache.
                    del waiting[index]
                    self._fail_outgrown(step, sequence)
                    continue
                break
            del waiting[index]
            if not loaded:
                cache.acquire_prefix(sequence.blocks, sequence.block_hashes, hit)
            cache.allocate(sequence.blocks, cached + tokens)
            if config.enable_prefix_caching:
                self._commit(sequence, cached + tokens)  # before the next admission, which may share them
            sequence.num_computed = cached
            sequence.prefilling = True
            if sequence.cached_tokens is None:
                sequence.cached_tokens = cached
                self.stats.record(total, cached)
                if host is not None:
                    self.host_stats.record(total, 0)
            running.append(sequence)
            step.scheduled[sequence] = tokens
            budget -= tokens
        return budget

    def _fail_outgrown(self, step: Step, sequence: Sequence) -> None:
        config = self.config
        sequence.error = (
            f"the sequence grew to {sequence.num_tokens} tokens, more than the KV cache "
            f"({config.num_gpu_blocks} blocks of {config.block_size}) holds"
        )
        self._finish(sequence, "error")
        step.dropped.append(sequence)

    def complete(self, step: Step) -> list[Sequence]:
        """Apply ``step`` (its time has passed): returns the sequences with new tokens or an end, those
        with their first token first (their consumers are woken in this order, so first tokens leave
        the worker, and reach the ingress, ahead of the step's other tokens)."""
        firsts: list[Sequence] = []
        touched = list(step.dropped)
        finished = False
        for sequence, tokens in step.scheduled.items():
            if sequence.done:
                continue  # aborted while the step ran
            computed = sequence.num_computed + tokens
            sequence.num_computed = computed
            if computed != sequence.num_tokens:
                continue  # a prefill chunk: no token yet
            token = sequence.next_token()
            self.generated_tokens += 1
            output = sequence.output
            (touched if output else firsts).append(sequence)
            output.append(token)
            sequence.num_tokens = computed + 1
            sequence.outbox.append(token)
            sequence.prefilling = False
            if len(output) >= sequence.max_tokens:
                self._finish(sequence, "length")
                finished = True
        if finished:
            self.running = [sequence for sequence in self.running if not sequence.done]
        firsts.extend(touched)
        return firsts

    # -- the host tier -----------------------------------------------------------------------------

    def _load(self, sequence: Sequence, hit: int, idle_hit: int, on_host: int) -> bool:
        """Take blocks for ``sequence``'s device prefix (``hit`` blocks) and the ``on_host`` blocks after it,
        and queue their copy back from the host; the sequence waits in ``loading`` until it ends.

        False, changing nothing, when the blocks of all its tokens would not fit beside what the sequences
        already loading will need (the reference's headroom for prefills in flight).
        """
        host = self.host
        assert host is not None
        block_size = self.config.block_size
        total = sequence.num_tokens
        more_blocks = -(-total // block_size) - hit + idle_hit
        if not self.cache.can_admit(more_blocks + self._loading_reserve()):
            return False
        prefix = hit + on_host
        self.cache.acquire_prefix(sequence.blocks, sequence.block_hashes, hit)
        self.cache.allocate(sequence.blocks, prefix * block_size)
        sequence.host_load, _ = host.load(sequence.block_hashes[hit:prefix], self.clock)
        sequence.num_computed = 0
        sequence.prefilling = True
        if sequence.cached_tokens is None:
            # The client sees both tiers' tokens as cached (vLLM counts a connector's tokens so); the rank's
            # prefix hit rate is the device's, the host tier's its own.
            sequence.cached_tokens = prefix * block_size
            self.stats.record(total, hit * block_size)
            self.host_stats.record(total, on_host * block_size)
        self.loading.append(sequence)
        return True

    def _loading_reserve(self) -> int:
        """Blocks the loading sequences will still take for the rest of their tokens."""
        if not self.loading:
            return 0
        block_size = self.config.block_size
        return sum(-(-sequence.num_tokens // block_size) - sequence.blocks.count for sequence in self.loading)

    def _host_tick(self) -> None:
        """Apply the host copies ended by now, start those reserved last step, and offer again what had no room."""
        host = self.host
        assert host is not None
        if ended := host.tick(self.clock):
            block_size = self.config.block_size
            back: list[Sequence] = []
            for ident in ended:
                sequence = next(waiting for waiting in self.loading if waiting.host_load == ident)
                self.loading.remove(sequence)
                sequence.host_load = None
                # Its prefix is on the device now: named (announced) as if computed, as vLLM caches blocks a
                # connector loaded once the load is done.
                full = sequence.blocks.count
                self.cache.commit(sequence.blocks, sequence.block_hashes, full)
                sequence.num_computed = full * block_size
                back.append(sequence)
            # Back to the front of the queue, in the order they were admitted, as vLLM puts them back.
            self.waiting.extendleft(reversed(back))
        host.submit(self.clock)
        if self._host_retry:
            retry, self._host_retry = self._host_retry, []
            for sequence, cohort in retry:
                if not sequence.done and not host.prepare(cohort):
                    self._host_retry.append((sequence, cohort))

    def _offer_to_host(self, step: Step) -> None:
        """Offer the host tier the prompt blocks this step named, one cohort per sequence (copied next step)."""
        host = self.host
        assert host is not None
        block_size = self.config.block_size
        for sequence in step.scheduled:
            named = min(len(sequence.blocks.cached), len(sequence.prompt) // block_size)
            start = sequence.host_offered
            if named <= start:
                continue
            hashes = sequence.block_hashes
            cohort = [(hashes[index], hashes[index - 1] if index else None) for index in range(start, named)]
            sequence.host_offered = named
            if not host.prepare(cohort):
                self._host_retry.append((sequence, cohort))

    def _cancel_load(self, sequence: Sequence) -> None:
        """Stop bringing ``sequence``'s prefix back (it ended); its blocks are freed by ``_finish``."""
        assert self.host is not None and sequence.host_load is not None
        self.host.cancel_load(sequence.host_load)
        sequence.host_load = None
        self.loading.remove(sequence)

    def _commit(self, sequence: Sequence, computed: int) -> None:
        """Name the blocks ``sequence`` fills up to its first ``computed`` tokens (scheduled this step)."""
        full = computed // self.config.block_size
        if full > len(sequence.blocks.cached):
            self._name_blocks(sequence, full)
            self.cache.commit(sequence.blocks, sequence.block_hashes, full)

    def _name_blocks(self, sequence: Sequence, full: int) -> None:
        """Extend ``sequence.block_hashes`` to its first ``full`` blocks (those holding generated tokens)."""
        hashes = sequence.block_hashes
        block_size = self.config.block_size
        while len(hashes) < full:
            start = len(hashes) * block_size
            parent = hashes[-1] if hashes else sequence.lora_root
            named = sequence_block_hashes(sequence.tokens(start, start + block_size), block_size, parent)
            self._note_lora(sequence, named)
            hashes.extend(named)

    def _note_lora(self, sequence: Sequence, hashes: list[int]) -> None:
        """Remember that ``hashes`` are blocks of ``sequence``'s adapter, for its KV events' ``lora_id``."""
        if sequence.lora_id is None or not self.cache.record_events:
            return
        lora_blocks = self._lora_blocks
        for block_hash in hashes:
            lora_blocks[block_hash] = sequence.lora_id
        # Bounded: blocks named and never cached (a request cancelled first) must not pile up. The oldest go
        # first; a cached block that lost its entry is announced without its lora_id (its hash is the adapter's
        # still: no base request can match it).
        while len(lora_blocks) > self._lora_blocks_kept:
            del lora_blocks[next(iter(lora_blocks))]

    def _tag_lora(self, events: list[KvEvent]) -> list[KvEvent]:
        """``events`` with each stored adapter block's ``lora_id`` set; the removed ones forgotten."""
        lora_blocks = self._lora_blocks
        if not lora_blocks:
            return events
        for event in events:
            if isinstance(event, BlockStored) and event.block_hashes:
                event.lora_id = lora_blocks.get(event.block_hashes[0])
            elif isinstance(event, BlockRemoved) and event.medium is None and self.host is None:
                for block_hash in event.block_hashes:
                    lora_blocks.pop(block_hash, None)
        return events

    def _preempt(self, sequence: Sequence) -> None:
        self.cache.free(sequence.blocks)
        sequence.num_computed = 0
        sequence.prefilling = True
        sequence.transferred = False
        self.waiting.appendleft(sequence)
        self.preemptions += 1

    def _finish(self, sequence: Sequence, reason: FinishReason) -> None:
        self.cache.free(sequence.blocks)
        sequence.done = True
        sequence.finish_reason = reason
