"""The scheduler with a host KV tier (``num_host_blocks``): prompt blocks copied out after the step that
computes them, a prefix evicted from the device brought back from the host instead of computed, with its
copy's time before the prefill. Time is the rank's simulated clock, moved as the engine moves it."""

import itertools

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.scheduler import Scheduler, Sequence, Step
from engines.mocker.timing import StepTimer, decode_ms, prefill_ms
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored, KvEvent

BLOCK = 4
#: 25 MB a token: a block is 100 MB, a tenth of a second at 1 GB/s.
KV_BYTES_PER_TOKEN = 25_000_000
BLOCK_COPY_S = 0.1
_ids = itertools.count()


class Flag:
    def __init__(self) -> None:
        self.stopped = False


def sequence(prompt: list[int], max_tokens: int = 1) -> Sequence:
    number = next(_ids)
    return Sequence(f"h{number}", prompt, max_tokens, seed=number, vocab_size=1000, stop=Flag())


class Rank:
    """A scheduler stepped as the engine steps it: each step starts at the clock and lasts the timer's time,
    or, when it computes nothing, until the next host copy ends."""

    def __init__(self, **settings: object) -> None:
        values: dict[str, object] = {
            "block_size": BLOCK,
            "num_gpu_blocks": 8,
            "num_host_blocks": 16,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
            "host_offload_d2h_bandwidth_gbps": 1.0,
            "host_offload_h2d_bandwidth_gbps": 1.0,
            **settings,
        }
        config = MockerConfig(**values)  # type: ignore[arg-type]
        self.scheduler = Scheduler(config)
        self.scheduler.set_record_events(True)
        self.timer = StepTimer(config)
        self.clock = 0.0
        self.events: list[KvEvent] = []
        #: Each step's prefill tokens, read before it is applied.
        self.prefill: dict[Step, int] = {}

    def step(self) -> tuple[Step, float]:
        """Run one step; returns it and the simulated time it started (its prefill tokens in ``prefill``)."""
        scheduler = self.scheduler
        started = self.clock
        step = scheduler.schedule(started)
        self.prefill[step] = step.prefill_tokens()
        if step.scheduled:
            self.clock += self.timer.step_seconds(step.prefill_tokens(), step.decode_tokens())
        else:
            self.clock += scheduler.idle_seconds()
        self.events.extend(scheduler.take_events())
        scheduler.complete(step)
        return step, started

    def run(self, *sequences: Sequence) -> list[tuple[Step, float]]:
        """Add ``sequences`` and step until the rank has nothing left to do (host copies included)."""
        for each in sequences:
            self.scheduler.add(each)
        steps = []
        while self.scheduler.has_work:
            steps.append(self.step())
            assert len(steps) < 1000
        return steps


def cpu_stored(events: list[KvEvent]) -> list[int]:
    return [
        block
        for event in events
        if isinstance(event, BlockStored) and event.medium == "cpu"
        for block in event.block_hashes
    ]


def device_stored(events: list[KvEvent]) -> list[int]:
    return [
        block
        for event in events
        if isinstance(event, BlockStored) and event.medium is None
        for block in event.block_hashes
    ]


def test_a_prompts_blocks_are_copied_to_the_host_once_stored_on_the_device_and_land_when_the_copy_ends() -> None:
    rank = Rank()
    first = sequence(list(range(12)), max_tokens=3)  # 3 full blocks
    rank.scheduler.add(first)
    rank.step()
    host = rank.scheduler.host
    assert host is not None
    assert device_stored(rank.events) == first.block_hashes and cpu_stored(rank.events) == []
    assert host.used_blocks == 3 and not any(host.holds(block) for block in first.block_hashes)
    # The copy starts when the computing step is over, and takes 3 blocks x 0.1 s while decoding goes on.
    _, copy_started = rank.step()
    deadline = host.next_deadline()
    assert deadline == pytest.approx(copy_started + 3 * BLOCK_COPY_S)
    while rank.clock < deadline or host.busy:
        assert not any(host.holds(block) for block in first.block_hashes)
        rank.step()
    assert all(host.holds(block) for block in first.block_hashes) and host.offloaded_blocks == 3
    assert cpu_stored(rank.events) == first.block_hashes
    landing = next(event for event in rank.events if isinstance(event, BlockStored) and event.medium == "cpu")
    assert landing.parent_hash is None


def test_only_prompt_blocks_are_copied_to_the_host() -> None:
    rank = Rank()
    first = sequence(list(range(8)), max_tokens=6)  # 2 prompt blocks; the output fills a third
    rank.run(first)
    assert len(first.block_hashes) == 3
    assert cpu_stored(rank.events) == first.block_hashes[:2]


def test_the_host_evicts_its_least_recently_used_blocks_and_says_so_on_the_cpu_tier() -> None:
    rank = Rank(num_host_blocks=3)
    first, second = sequence(list(range(12))), sequence(list(range(100, 112)))
    rank.run(first)
    rank.run(second)
    assert cpu_stored(rank.events) == [*first.block_hashes, *second.block_hashes]
    removed = [event for event in rank.events if isinstance(event, BlockRemoved)]
    assert removed == [BlockRemoved(first.block_hashes, medium="cpu")]


def evict_from_device(rank: Rank, prompt: list[int]) -> Sequence:
    """Run ``prompt`` until its blocks are on the host, then a prompt filling the whole device after it."""
    first = sequence(prompt)
    rank.run(first)
    rank.run(sequence(list(range(1000, 1000 + 8 * BLOCK))))  # every device block: the first's are evicted
    cache = rank.scheduler.cache
    assert cache.prefix_hit(first.block_hashes, len(first.block_hashes)) == (0, 0)
    return first


def test_a_prefix_evicted_from_the_device_but_on_the_host_is_brought_back_and_not_recomputed() -> None:
    rank = Rank()
    prompt = list(range(16))  # 4 blocks: 3 come back, the last is computed as vLLM always computes one
    evict_from_device(rank, prompt)
    again = sequence(prompt)
    rank.scheduler.add(again)
    loading, load_started = rank.step()
    assert loading.scheduled == {} and rank.scheduler.loading == [again]
    assert again.cached_tokens == 12
    steps = rank.run()
    computing, computing_started = next((step, started) for step, started in steps if again in step.scheduled)
    assert computing.scheduled[again] == 4 and rank.prefill[computing] == 4
    # Its H2D copy (3 blocks x 0.1 s) came before its prefill: its first token waits for it.
    assert computing_started >= load_started + 3 * BLOCK_COPY_S
    assert again.output and rank.scheduler.host is not None and rank.scheduler.host.onboarded_blocks == 3
    # The blocks that came back are the device's again, announced as computed blocks are.
    assert device_stored(rank.events).count(again.block_hashes[0]) == 2


def test_without_a_host_tier_the_same_prompt_is_computed_again_in_full() -> None:
    rank = Rank(num_host_blocks=None, host_offload_d2h_bandwidth_gbps=None, host_offload_h2d_bandwidth_gbps=None)
    prompt = list(range(16))
    first = sequence(prompt)
    rank.run(first)
    rank.run(sequence(list(range(1000, 1000 + 8 * BLOCK))))
    again = sequence(prompt)
    (step, _), *_ = rank.run(again)
    assert step.scheduled[again] == 16 and rank.prefill[step] == 16 and again.cached_tokens == 0


def test_a_prompt_whose_prefix_is_still_being_copied_to_the_host_waits_and_the_others_go_ahead() -> None:
    rank = Rank(host_offload_d2h_bandwidth_gbps=0.01)  # 10 s a block out; back at 0.1 s
    prompt = list(range(16))
    first = sequence(prompt)
    rank.scheduler.add(first)
    rank.step()
    filler = sequence(list(range(1000, 1000 + 8 * BLOCK)))
    rank.scheduler.add(filler)
    rank.step()  # the first's copy out starts (4 blocks, 40 s) as the filler takes every device block
    assert filler.done and rank.scheduler.cache.prefix_hit(first.block_hashes, 4) == (0, 0)
    again, other = sequence(prompt), sequence(list(range(500, 508)))
    rank.scheduler.add(again)
    rank.scheduler.add(other)
    step, _ = rank.step()
    assert other in step.scheduled and again not in step.scheduled
    assert list(rank.scheduler.waiting) == [again] and not rank.scheduler.loading
    steps = rank.run()
    host = rank.scheduler.host
    assert host is not None and host.onboarded_blocks == 3  # it waited for the copy out, then took it back
    assert next(step for step, _ in steps if again in step.scheduled).scheduled[again] == 4


def test_a_request_that_leaves_while_its_prefix_comes_back_frees_its_blocks() -> None:
    rank = Rank()
    prompt = list(range(16))
    evict_from_device(rank, prompt)
    again = sequence(prompt)
    rank.scheduler.add(again)
    rank.step()
    assert rank.scheduler.loading == [again] and rank.scheduler.cache.active_blocks == 3
    rank.scheduler.abort(again)
    assert again.done and not rank.scheduler.loading and rank.scheduler.cache.active_blocks == 0
    assert not rank.scheduler.has_work  # its copy back is dropped


def test_the_cache_state_lists_the_device_then_the_host_tier() -> None:
    rank = Rank()
    first = sequence(list(range(12)))
    rank.run(first)
    state = rank.scheduler.cache_state()
    assert state == [
        BlockStored(first.block_hashes, None),
        BlockStored(first.block_hashes, None, medium="cpu"),
    ]


def test_a_reset_of_the_device_does_not_tell_routers_that_everything_is_cleared() -> None:
    rank = Rank()
    first = sequence(list(range(12)))
    rank.run(first)
    rank.scheduler.cache.reset_prefix_cache()
    events = rank.scheduler.take_events()
    assert not any(isinstance(event, AllCleared) for event in events)
    assert [sorted(event.block_hashes) for event in events] == [sorted(first.block_hashes)]
    assert all(isinstance(event, BlockRemoved) and event.medium is None for event in events)
    assert rank.scheduler.cache_state() == [BlockStored(first.block_hashes, None, medium="cpu")]


def test_the_host_hit_rate_counts_prompt_tokens_brought_back_from_the_host() -> None:
    rank = Rank()
    prompt = list(range(16))
    evict_from_device(rank, prompt)
    rank.run(sequence(prompt))
    stats = rank.scheduler.host_stats
    # Three first admissions: 16 + 32 + 16 prompt tokens, 12 of them brought back.
    assert stats.hit_rate == pytest.approx(12 / 64)


def test_a_host_tier_is_refused_under_v0() -> None:
    with pytest.raises(ValueError, match="v1"):
        Rank(scheduler="v0")


def test_a_prefix_brought_back_beside_a_decode_is_timed_as_dynamos_mocker_times_it() -> None:
    """bench/kv_tiers_vs_dynamo.py's geometry on one rank: a long decode (a) while a document (b's) is pushed
    off the device (by c) and asked for again (e): e's prefix comes back from the host, and the step that
    computes its last 64 tokens beside a's decode costs a 64-token prefill plus a's decode alone (e gets its
    first token from that pass, so it is not in the decode batch, and its copy back is not charged there).

    Every time below is Dynamo 1.6.1's, from its own core in simulated time (``dynamo.replay``'s
    ``run_trace_replay``, offline, one worker, the same settings and arrivals as a Mooncake trace); Flotilla's
    match them to the microsecond.
    """
    rank = Rank(
        block_size=64,
        num_gpu_blocks=136,
        num_host_blocks=904,
        kv_bytes_per_token=23040,
        host_offload_d2h_bandwidth_gbps=25.0,
        host_offload_h2d_bandwidth_gbps=25.0,
    )

    def prompt(document: int, question: int) -> list[int]:
        return [document * 10_000 + offset for offset in range(4096)] + [question * 100 + n for n in range(64)]

    a, b = sequence(prompt(1, 1), max_tokens=200), sequence(prompt(2, 2), max_tokens=2)
    c, e = sequence(prompt(3, 3), max_tokens=2), sequence(prompt(2, 4), max_tokens=32)
    arrivals = [(0.0, a), (0.0, b), (0.4, c), (0.8, e)]
    tokens: dict[Sequence, list[float]] = {each: [] for _, each in arrivals}
    onboard: tuple[Step, float, float, int] | None = None
    scheduler = rank.scheduler
    while arrivals or scheduler.has_work:
        while arrivals and arrivals[0][0] <= rank.clock:
            scheduler.add(arrivals.pop(0)[1])
        if not scheduler.has_work:
            rank.clock = arrivals[0][0]
            continue
        # Each token leaves when its step ends: read the tokens after the step, against the clock then.
        before = {each: len(each.output) for each in tokens}
        decoding = a.num_tokens  # a's length in the step: its prompt and its output so far
        step, started = rank.step()
        if e in step.scheduled:
            onboard = onboard or (step, started, rank.clock, decoding)
        for each, count in before.items():
            tokens[each].extend([rank.clock] * (len(each.output) - count))
    ms = {each: [time * 1000 for time in times] for each, times in tokens.items()}
    assert ms[a][0] == pytest.approx(169.136918, abs=1e-3) and ms[a][-1] == pytest.approx(5734.093568, abs=1e-3)
    assert ms[b][0] == pytest.approx(213.265966, abs=1e-3)
    assert ms[c][0] == pytest.approx(513.924972, abs=1e-3)
    assert ms[e][0] == pytest.approx(874.008397, abs=1e-3) and ms[e][-1] == pytest.approx(1924.194468, abs=1e-3)
    # 4 of e's 64 document blocks were still on the device, 60 came back from the host (Dynamo's 256 + 3840).
    host = scheduler.host
    assert host is not None and host.onboarded_blocks == 60 and e.cached_tokens == 4096
    assert onboard is not None
    step, started, ended, decoding = onboard
    assert step.scheduled == {a: 1, e: 64} and rank.prefill[step] == 64
    assert (ended - started) * 1000 == pytest.approx(prefill_ms(64) + decode_ms(decoding / (136 * 64)), abs=1e-9)
    assert (ended - started) * 1000 == pytest.approx(43.223, abs=1e-3)
