"""What the mocker's scheduler does under ``"scheduler": "v1"`` (the default) as vLLM v1 does, and v0 not.

Each test runs under v1 and asserts what v1 does; ``test_v0_does_otherwise`` runs the same scenarios
under v0 and checks they come out the v0 way, so every v1 test here fails with the v0 behaviour.
"""

import itertools
import random
from collections.abc import Callable

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.kv_cache_v1 import KvCacheV1
from engines.mocker.scheduler import Scheduler, Sequence, Step
from runtime.errors import EngineError
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored

BLOCK = 4
_ids = itertools.count()


class Flag:
    def __init__(self) -> None:
        self.stopped = False


def sequence(prompt: list[int], max_tokens: int = 4) -> Sequence:
    number = next(_ids)
    return Sequence(f"s{number}", prompt, max_tokens, seed=number, vocab_size=1000, stop=Flag())


def scheduler(version: str = "v1", **settings: object) -> Scheduler:
    values: dict[str, object] = {"block_size": BLOCK, "num_gpu_blocks": 64, "scheduler": version, **settings}
    return Scheduler(MockerConfig(**values))  # type: ignore[arg-type]


def run_step(rank: Scheduler) -> Step:
    step = rank.schedule()
    rank.complete(step)
    return step


# -- each scenario returns True when it came out the v1 way ---------------------------------------


def two_identical_prompts_in_one_step_hold_separate_copies_of_their_last_block(version: str) -> bool:
    rank = scheduler(version)
    rank.cache.record_events = True
    prompt = list(range(12))  # 3 full blocks
    first, second = sequence(prompt), sequence(prompt)
    rank.add(first)
    rank.add(second)
    step = rank.schedule()
    # The second hits the first's blocks but its last (v1 recomputes a fully cached prompt's last block).
    assert step.scheduled == {first: 12, second: 4} and second.cached_tokens == 8
    stored = [event for event in rank.cache.take_events() if isinstance(event, BlockStored)]
    assert [chain.block_hashes for chain in stored] == [first.block_hashes]  # the copy is not announced again
    if rank.cache.active_blocks == 3:
        return False  # merged into the first's block
    assert rank.cache.active_blocks == 4
    assert isinstance(rank.cache, KvCacheV1) and rank.cache.copies(first.block_hashes[2]) == 2
    return True


def no_watermark_holds_blocks_back_from_a_new_prompt(version: str) -> bool:
    rank = scheduler(version, num_gpu_blocks=100, max_num_batched_tokens=400)
    whole = sequence(list(range(400)))  # every block of the cache
    try:
        rank.add(whole)
    except EngineError:
        return False  # v0: the 1% watermark leaves it 99 blocks
    assert run_step(rank).scheduled == {whole: 400} and rank.cache.active_blocks == 100
    return True


SCENARIOS: list[Callable[[str], bool]] = [
    two_identical_prompts_in_one_step_hold_separate_copies_of_their_last_block,
    no_watermark_holds_blocks_back_from_a_new_prompt,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.__name__)
def test_v1(scenario: Callable[[str], bool]) -> None:
    assert scenario("v1")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.__name__)
def test_v0_does_otherwise(scenario: Callable[[str], bool]) -> None:
    assert not scenario("v0")


def test_v1_is_the_default() -> None:
    rank = Scheduler(MockerConfig(block_size=BLOCK, num_gpu_blocks=64))
    assert isinstance(rank.cache, KvCacheV1)


def test_prefix_hits_are_counted_once_when_a_prompt_is_first_admitted() -> None:
    rank = scheduler(num_gpu_blocks=6, max_num_batched_tokens=8)
    prompt = list(range(12))
    rank.add(sequence(prompt, max_tokens=1))
    run_step(rank)
    run_step(rank)
    assert rank.stats.prompt_tokens == 12 and rank.stats.cached_tokens == 0
    hog = sequence(list(range(100, 124)), max_tokens=30)  # 6 blocks: it takes the whole cache, chunk by chunk
    again = sequence(prompt, max_tokens=1)
    rank.add(hog)
    rank.add(again)
    run_step(rank)
    # `again` waits behind `hog` (for the budget, then for blocks): not counted until it is admitted.
    assert (rank.stats.prompt_tokens, rank.stats.cached_tokens) == (12 + 24, 0)
    while again.cached_tokens is None:
        run_step(rank)
    assert (rank.stats.prompt_tokens, rank.stats.cached_tokens) == (12 + 24 + 12, again.cached_tokens)


def test_a_sequence_that_outgrows_the_cache_fails_instead_of_preempting_itself_forever() -> None:
    rank = scheduler(num_gpu_blocks=4, max_num_batched_tokens=8)
    seq = sequence(list(range(12)), max_tokens=10)  # 12 + 10 tokens: 6 blocks, in a cache of 4
    rank.add(seq)
    for _ in range(50):
        if not rank.has_work:
            break
        run_step(rank)
    assert seq.done and seq.finish_reason == "error"
    assert seq.error is not None and "more than the KV cache" in seq.error


def test_the_kv_events_always_say_which_blocks_the_rank_can_hit() -> None:
    # A busy little cache: shared prefixes prefilled side by side, copies, evictions, preemptions.
    rank = scheduler(num_gpu_blocks=16, max_num_batched_tokens=12, max_num_seqs=6)
    cache = rank.cache
    assert isinstance(cache, KvCacheV1)
    cache.record_events = True
    rng = random.Random(5)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    known: set[int] = set()
    copies_seen = evictions = 0
    for step_number in range(400):
        if step_number % 2 == 0 and len(rank.waiting) < 4:
            tail = [rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
            rank.add(sequence([*rng.choice(prefixes), *tail], max_tokens=rng.randrange(1, 20)))
        run_step(rank)
        for event in cache.take_events():
            if isinstance(event, BlockStored):
                assert not known & set(event.block_hashes), "a hash announced twice"
                known.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= known
                known.difference_update(event.block_hashes)
                evictions += 1
            else:
                assert isinstance(event, AllCleared)
                known.clear()
        held = {block_hash for chain in cache.cache_state() for block_hash in chain.block_hashes}
        assert known == held
        copies_seen = max(copies_seen, max((cache.copies(block_hash) for block_hash in held), default=0))
    assert copies_seen >= 2 and evictions > 0 and rank.preemptions > 0  # the workload did reach every case
