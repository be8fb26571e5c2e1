"""The mocker engine (``out=mocker``): a vLLM-like engine with no weights, for testing and benchmarks.

It takes token ids like any token engine and answers with pseudo-random tokens, at the pace the
timing model (timing.py) gives a real engine on a GPU, divided by ``speedup_ratio``. Each of its
``dp_size`` ranks has its own scheduler and KV cache (scheduler.py, kv_cache_v0.py or kv_cache_v1.py) and its own step
loop: plan a step, wait its simulated time, apply it, hand each sequence's new tokens to its
consumer. A request goes to the rank the router chose (``dp_rank``), else to the least loaded one.

It is a ``KvEventSource``: once a sink is attached, every step's KV events (blocks stored,
removed, all cleared) go to it per rank once the step's simulated time has passed (as Dynamo's
mocker publishes them: a router never sends a request after blocks still being computed), and
``load()`` / ``cache_state()`` say what each rank holds, so that the worker publishes them as a real
engine's would (runtime/kv/publisher.py).

Disaggregated serving (docs/disaggregation.md): sent a ``prefill_only`` request, it computes the prompt and
one token and ends with a ``KvHandoff`` whose ``transfer_s`` is the modelled time to move the prompt's KV
(prompt tokens × ``kv_bytes_per_token`` ÷ ``kv_transfer_bandwidth``, as Dynamo's mocker models it). Sent a
request with a mocker ``handoff``, it waits that time (over ``speedup_ratio``), then admits the sequence as
any other, blocks and budget included, but its prompt costs no prefill time: the KV came computed. A
decode worker still times a prompt it computes itself (no handoff, or after a preemption), unlike
Dynamo's mocker, whose decode workers take every prefill for free.

With ``num_host_blocks`` each rank also has a host-memory KV tier (host_tier.py): its copies run in the rank's
simulated time (``Scheduler.schedule(now)``), a step with nothing to compute waits for the next copy to end,
its events (``medium="cpu"``) go out with the device's, and ``load()`` reports it in ``WorkerLoad.tiers``.

LoRA adapters (runtime/lora.py): it is a ``LoraEngine`` holding ``max_loras`` adapters, each "loaded" in
``lora_load_time`` seconds from a path that must exist (nothing is read from it). A request with ``lora_name``
runs as any other, but its blocks chain from the adapter's root hash (``lora_root_hash``), so that its prefix
is reused by requests of the same adapter only, and its KV events carry the adapter's ``lora_id``.

A step loop that fails is logged, every request it held fails with an EngineError, and the rank
starts again with an empty cache (routers are told: all cleared); nothing waits forever.
"""

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Literal

from engines.mocker.config import MockerConfig
from engines.mocker.precise_sleep import PreciseSleeper
from engines.mocker.scheduler import Scheduler, Sequence
from engines.mocker.timing import StepTimer
from runtime.engine import RequestContext
from runtime.errors import EngineError
from runtime.kv.events import AllCleared, BlockStored, KvEventSink, TierLoad, WorkerLoad
from runtime.lora import lora_id
from runtime.protocol import EngineOutput, KvHandoff, PreprocessedRequest

log = logging.getLogger(__name__)

#: Longest run of steps without letting other tasks run, when the steps are behind their simulated
#: time (the CPU, not the simulated GPU, is the limit: high speed-ups). Consumers then take the
#: tokens of several steps at once, as a real engine's output stage does when its reader lags.
MAX_BURST_S = 0.0002
#: Steps run back to back in simulated time: the loop's own Python work between two steps (scheduling,
#: block hashes, KV events) stands for what a real engine overlaps with the forward pass, so it does not
#: delay the next step, which starts when the previous one ends. Only a loop further behind real time
#: than this (a CPU-bound worker) starts its next step from now, rather than pretend the time passed.
MAX_LAG_S = 0.02
#: Shorter waits are not slept: a timer cannot end them much closer to their time than waking costs
#: (tens of microseconds), so at high speed-ups the steps run on and the clock makes up the difference
#: once the simulated time it owes passes this.
MIN_SLEEP_S = 0.00005
#: ``KvHandoff.kind`` of a mocker's prefill: another mocker takes it; any other engine computes the prompt.
MOCKER_HANDOFF = "mocker"


class _Rank:
    """One dp rank: its scheduler, the event that wakes its idle step loop, and that loop."""

    __slots__ = ("index", "scheduler", "sleeper", "task", "wake")

    def __init__(self, index: int, scheduler: Scheduler) -> None:
        self.index = index
        self.scheduler = scheduler
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        #: Steps end on their simulated time to the microsecond, not at the loop's next millisecond tick.
        self.sleeper = PreciseSleeper()


class MockerEngine:
    """A token engine that simulates vLLM's scheduling, KV cache and timing. ``start()`` runs its ranks."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(self, config: MockerConfig, *, vocab_size: int) -> None:
        """Raises ValueError for a vocabulary below two tokens (one must be left besides an end)."""
        if vocab_size < 2:
            raise ValueError(f"the mocker needs a vocabulary of at least 2 tokens, not {vocab_size}")
        self.config = config
        self.vocab_size = vocab_size
        self._timer = StepTimer(config)
        self._ranks = [_Rank(index, Scheduler(config)) for index in range(config.dp_size)]
        self._sink: KvEventSink | None = None
        self._running = False
        #: Prompt tokens it computes in a step, over its ranks (registered: ``--disagg-policy load`` reads it).
        self.prefill_token_capacity = config.max_num_batched_tokens * config.dp_size
        #: LoRA adapters it holds at once; those loaded, by name -> (their path, their lora_id).
        self.max_loras = config.max_loras
        self._loras: dict[str, tuple[Path, int]] = {}

    # -- LoRA adapters (LoraEngine) -------------------------------------------------------------------

    @property
    def loras(self) -> dict[str, Path]:
        """The adapters loaded, by name: their paths."""
        return {name: path for name, (path, _) in self._loras.items()}

    async def load_lora(self, name: str, path: Path) -> None:
        """Load adapter ``name`` from ``path`` (a folder or a file that must exist); the same name and path again
        does nothing, a new path replaces the old. Raises EngineError for a missing path or one adapter too many."""
        loaded = self._loras.get(name)
        if loaded is not None and loaded[0] == path:
            return
        if not await asyncio.to_thread(path.exists):  # a network file system may take its time
            raise EngineError(f"adapter {name!r}: {path} does not exist (give a PEFT folder or an adapter file)")
        if loaded is None and len(self._loras) >= self.max_loras:
            raise EngineError(
                f"adapter {name!r} not loaded: the mocker holds {self.max_loras} adapters at most (max_loras), and "
                f"has {', '.join(sorted(self._loras))}; unload one first, or raise max_loras"
            )
        if self.config.lora_load_time:
            await asyncio.sleep(self.config.lora_load_time)
        self._loras[name] = (path, lora_id(name))

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name``: its requests still running finish (their blocks stay cached until evicted)."""
        self._loras.pop(name, None)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait ``startup_time`` (a real engine loads weights meanwhile), then start a step loop per rank."""
        if self.config.startup_time:
            await asyncio.sleep(self.config.startup_time)
        for rank in self._ranks:
            if not rank.sleeper.precise:  # closed by an earlier close(), or no timerfd here
                rank.sleeper = PreciseSleeper()
            rank.task = asyncio.create_task(self._supervise(rank), name=f"mocker dp rank {rank.index}")
        self._running = True

    async def close(self) -> None:
        """Stop the step loops; requests still in flight end with an EngineError."""
        self._running = False
        tasks = [rank.task for rank in self._ranks if rank.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rank in self._ranks:
            rank.task = None
            rank.sleeper.close()
            _wake(rank.scheduler.fail_all("the mocker engine was closed"))

    # -- requests ----------------------------------------------------------------------------------

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        """Yield the request's tokens step by step until ``max_tokens`` (finish "length").

        The first output carries ``cached_tokens``. Raises EngineError for a prompt the engine could
        never schedule, for an engine not started, and when the rank's step loop failed.
        """
        if not self._running:
            raise EngineError("the mocker engine is not running")
        adapter: int | None = None
        if request.lora_name is not None:
            loaded = self._loras.get(request.lora_name)
            if loaded is None:
                raise EngineError(f"LoRA adapter {request.lora_name!r} is not loaded on this worker")
            adapter = loaded[1]
        max_tokens = request.stop_conditions.max_tokens
        if request.prefill_only:
            max_tokens = 1  # the prompt and the token its pass gives: the rest is the decode worker's
        if max_tokens <= 0:
            yield EngineOutput([], "length", cached_tokens=0)
            return
        handoff = request.handoff
        transferred = handoff is not None and handoff.kind == MOCKER_HANDOFF
        if transferred and handoff is not None and (wait := self._simulated(handoff.transfer_s)) > 0:
            await asyncio.sleep(wait)  # the prompt's KV on its way from the prefill worker
            if context.stopped:
                return
        seed = request.sampling.seed
        sequence = Sequence(
            request.request_id,
            request.token_ids,
            max_tokens,
            seed=zlib.crc32(request.request_id.encode()) if seed is None else seed,
            vocab_size=self.vocab_size,
            stop=context,
            eos_token_ids=request.eos_token_ids,
            lora_id=adapter,
        )
        sequence.transferred = transferred
        rank = self._pick_rank(request.dp_rank)
        scheduler = rank.scheduler
        scheduler.add(sequence)
        rank.wake.set()
        loop = asyncio.get_running_loop()
        first = True
        try:
            while True:
                if not sequence.outbox and not sequence.done:
                    waiter = loop.create_future()
                    sequence.waiter = waiter
                    await waiter
                if sequence.error is not None:
                    raise EngineError(sequence.error)
                finish = sequence.finish_reason
                if finish == "cancelled":
                    return  # the client went away: nobody reads any more
                tokens = sequence.outbox
                sequence.outbox = []
                output = EngineOutput(tokens, finish, sequence.cached_tokens if first else None)
                if request.prefill_only and finish is not None:
                    output.handoff = self._handoff(len(request.token_ids), sequence.cached_tokens or 0)
                yield output
                first = False
                if finish is not None or context.stopped:
                    return
        finally:
            # Stopped, cancelled or closed early: the blocks go back now, not at the next step.
            if not sequence.done:
                scheduler.abort(sequence)

    def _handoff(self, prompt_tokens: int, cached_tokens: int) -> KvHandoff:
        """What a prefill of ``prompt_tokens`` hands on: the modelled time its KV takes to move (simulated s)."""
        config = self.config
        transfer_s = 0.0
        if config.kv_transfer_bandwidth and config.kv_bytes_per_token:
            transfer_s = prompt_tokens * config.kv_bytes_per_token / (config.kv_transfer_bandwidth * 1e9)
        return KvHandoff(
            kind=MOCKER_HANDOFF, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            transfer_s=transfer_s,
        )  # fmt: skip

    def _simulated(self, seconds: float) -> float:
        """Real seconds for ``seconds`` of simulated time (0 at speed-up 0: nothing waits)."""
        speedup = self.config.speedup_ratio
        return seconds / speedup if speedup else 0.0

    def _pick_rank(self, dp_rank: int | None) -> _Rank:
        ranks = self._ranks
        if dp_rank is not None and 0 <= dp_rank < len(ranks):
            return ranks[dp_rank]
        if len(ranks) == 1:
            return ranks[0]
        return min(ranks, key=_rank_load)

    # -- the step loops ----------------------------------------------------------------------------

    async def _supervise(self, rank: _Rank) -> None:
        """Run ``rank``'s step loop; if it fails, fail its requests, start it afresh and go on."""
        while True:
            try:
                await self._step_loop(rank)
            except Exception as exc:
                log.exception("the step loop of mocker dp rank %d failed; its requests fail", rank.index)
                failed = rank.scheduler.fail_all(f"the mocker's dp rank {rank.index} failed: {exc!r}")
                rank.scheduler = self._fresh_scheduler()
                if self._sink is not None:
                    self._sink.publish(rank.index, [AllCleared()])
                _wake(failed)

    async def _step_loop(self, rank: _Rank) -> None:
        scheduler = rank.scheduler
        step_seconds = self._timer.step_seconds
        wake = rank.wake
        sleep_until = rank.sleeper.sleep_until
        now = time.monotonic  # the loop's own clock has millisecond resolution under uvloop
        # Simulated time: where the steps run so far would have ended. Sleeps aim at it, so that steps
        # shorter than the timer's resolution add up instead of each rounding to nothing.
        clock = yielded = now()
        while True:
            if not scheduler.has_work:
                wake.clear()
                await wake.wait()
                yielded = now()
            started = now()
            if started - clock > MAX_LAG_S or not scheduler.running:
                clock = started  # idle before (nothing was running), or far behind: simulated time restarts now
            step = scheduler.schedule(clock)
            if step.scheduled:
                duration = step_seconds(step.prefill_tokens(), step.decode_tokens())
            else:
                duration = scheduler.idle_seconds()  # nothing to compute: wait for the next host copy to end
            clock += duration
            ahead = clock - now()
            if ahead > MIN_SLEEP_S:
                await sleep_until(clock)
                yielded = now()
            elif started - yielded >= MAX_BURST_S:
                await asyncio.sleep(0)
                yielded = now()
            # The step's KV events once its pass is over, as Dynamo's mocker publishes them: a router never
            # sends a request after blocks still being computed.
            sink = self._sink
            if sink is not None and (events := scheduler.take_events()):
                sink.publish(rank.index, events)
            _wake(scheduler.complete(step))

    def _fresh_scheduler(self) -> Scheduler:
        scheduler = Scheduler(self.config)
        scheduler.set_record_events(self._sink is not None)
        return scheduler

    # -- KvEventSource ------------------------------------------------------------------------------

    def attach_kv_events(self, sink: KvEventSink) -> None:
        """Send every rank's KV events to ``sink`` from now on."""
        self._sink = sink
        for rank in self._ranks:
            rank.scheduler.set_record_events(True)

    def load(self) -> list[WorkerLoad]:
        """Each rank's requests, KV usage and prefix hit rate (over its last admissions); ``instance_id`` 0."""
        loads: list[WorkerLoad] = []
        for rank in self._ranks:
            scheduler = rank.scheduler
            cache = scheduler.cache
            # A sequence waiting for its prefix to come back from the host is waiting, as vLLM counts it.
            running, waiting = len(scheduler.running), len(scheduler.waiting) + len(scheduler.loading)
            loads.append(
                WorkerLoad(
                    instance_id=0,
                    dp_rank=rank.index,
                    active_requests=running + waiting,
                    running=running,
                    waiting=waiting,
                    kv_active_blocks=cache.active_blocks,
                    kv_total_blocks=cache.num_blocks,
                    kv_usage=cache.usage,
                    prefix_hit_rate=scheduler.stats.hit_rate,
                    generated_tokens=scheduler.generated_tokens,
                    preemptions=scheduler.preemptions,
                    tiers=_host_tiers(scheduler),
                )
            )
        return loads

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        """Every cached block of rank ``dp_rank`` (None: of every rank), as stored events in prefix order."""
        ranks = self._ranks if dp_rank is None else self._ranks[dp_rank : dp_rank + 1] if dp_rank >= 0 else []
        return {rank.index: rank.scheduler.cache_state() for rank in ranks}

    def reset_prefix_cache(self) -> int:
        """Drop every idle cached block of every rank (routers are told); returns how many were dropped."""
        dropped = 0
        for rank in self._ranks:
            scheduler = rank.scheduler
            dropped += scheduler.cache.reset_prefix_cache()
            if self._sink is not None and (events := scheduler.take_events()):
                self._sink.publish(rank.index, events)
        return dropped


def _rank_load(rank: _Rank) -> tuple[int, int]:
    scheduler = rank.scheduler
    return len(scheduler.running) + len(scheduler.waiting) + len(scheduler.loading), scheduler.cache.active_blocks


def _host_tiers(scheduler: Scheduler) -> list[TierLoad] | None:
    """The rank's host tier as ``WorkerLoad.tiers``; None without one."""
    host = scheduler.host
    if host is None:
        return None
    used = host.used_blocks
    return [
        TierLoad(
            medium="cpu",
            total_blocks=host.num_blocks,
            used_blocks=used,
            usage=used / host.num_blocks,
            hit_rate=scheduler.host_stats.hit_rate,
            offloaded_blocks=host.offloaded_blocks,
            onboarded_blocks=host.onboarded_blocks,
        )
    ]


def _wake(sequences: Iterable[Sequence]) -> None:
    """Wake the consumers of ``sequences`` that wait for news."""
    for sequence in sequences:
        waiter = sequence.waiter
        if waiter is not None:
            sequence.waiter = None
            if not waiter.done():
                waiter.set_result(None)
