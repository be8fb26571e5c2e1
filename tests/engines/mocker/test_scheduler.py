"""The mocker's vLLM-like scheduler: batch limits, chunked prefill, preemption, prefix hits.

Every test here holds for both ``scheduler`` settings and runs under each; test_scheduler_v1.py has
what v1 does differently.
"""

import itertools

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.scheduler import Scheduler, Sequence, Step
from runtime.errors import EngineError
from runtime.kv.blocks import sequence_block_hashes

BLOCK = 4
_ids = itertools.count()
#: The settings every scheduler() of a test starts from; the fixture below sets "scheduler".
DEFAULTS: dict[str, object] = {"block_size": BLOCK, "num_gpu_blocks": 64}


@pytest.fixture(autouse=True, params=["v0", "v1"])
def version(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(DEFAULTS, "scheduler", request.param)
    return str(request.param)


class Flag:
    def __init__(self) -> None:
        self.stopped = False


def sequence(prompt: list[int], max_tokens: int = 4, *, eos: tuple[int, ...] = (), vocab: int = 1000) -> Sequence:
    number = next(_ids)
    return Sequence(f"s{number}", prompt, max_tokens, seed=number, vocab_size=vocab, stop=Flag(), eos_token_ids=eos)


def scheduler(**settings: object) -> Scheduler:
    values: dict[str, object] = {**DEFAULTS, **settings}
    return Scheduler(MockerConfig(**values))  # type: ignore[arg-type]


def run_step(rank: Scheduler) -> tuple[Step, list[Sequence]]:
    step = rank.schedule()
    return step, rank.complete(step)


def test_a_sequence_prefills_then_decodes_one_token_per_step_until_max_tokens() -> None:
    rank = scheduler()
    seq = sequence(list(range(10)), max_tokens=3)
    rank.add(seq)
    step = rank.schedule()
    # The prefill's forward pass gives the first token: no decode pass in this step.
    assert step.scheduled == {seq: 10} and step.prefill_tokens() == 10 and step.decode_tokens() == 0
    assert rank.complete(step) == [seq] and len(seq.output) == 1
    step = rank.schedule()
    # The decode pass is timed by the sequence's length: its prompt and the token it computes now.
    assert step.scheduled == {seq: 1} and step.prefill_tokens() == 0 and step.decode_tokens() == 11
    rank.complete(step)
    run_step(rank)
    assert seq.done and seq.finish_reason == "length" and len(seq.output) == 3
    assert not rank.has_work
    assert rank.cache.active_blocks == 0


def test_a_step_returns_the_sequences_with_their_first_token_ahead_of_the_others() -> None:
    # Their consumers are woken in this order, so a first token leaves the worker before the step's
    # other tokens (time to first token is what routing and admission are judged by).
    rank = scheduler()
    older = [sequence([n] * 6, max_tokens=8) for n in range(2)]
    for seq in older:
        rank.add(seq)
    run_step(rank)
    newer = sequence([9] * 6, max_tokens=8)
    rank.add(newer)
    step, touched = run_step(rank)
    assert list(step.scheduled) == [*older, newer]  # the running ones are scheduled first
    assert touched == [newer, *older]
    assert [len(seq.output) for seq in touched] == [1, 2, 2]


def test_a_steps_prefill_counts_prompt_tokens_by_integer_means_as_dynamos_mocker() -> None:
    fresh, resumed, decoding = sequence(list(range(10))), sequence(list(range(37))), sequence(list(range(5)))
    resumed.num_computed = 32  # a cached prefix, or the chunks of earlier steps
    decoding.num_computed, decoding.num_tokens, decoding.prefilling = 6, 7, False  # prompt and 2 tokens out
    step = Step()
    step.scheduled = {fresh: 10, resumed: 5, decoding: 1}
    # n (2) x (mean of the prompt lengths reached, 47 // 2, less the mean computed before, 32 // 2) = 14,
    # not the 15 tokens computed: Dynamo 1.6.1 takes the same integer means.
    assert step.prefill_tokens() == 2 * (47 // 2 - 32 // 2) == 14
    assert step.decode_tokens() == 7
    assert Step().prefill_tokens() == 0 and Step().decode_tokens() == 0


def test_max_num_seqs_caps_the_running_batch() -> None:
    rank = scheduler(max_num_seqs=2)
    sequences = [sequence([n] * 5) for n in range(3)]
    for seq in sequences:
        rank.add(seq)
    step, _ = run_step(rank)
    assert list(step.scheduled) == sequences[:2]
    assert list(rank.waiting) == sequences[2:]


def test_the_token_budget_caps_a_step_and_chunks_a_long_prompt() -> None:
    rank = scheduler(max_num_batched_tokens=16)
    long, short = sequence(list(range(40))), sequence(list(range(100, 105)))
    rank.add(long)
    rank.add(short)
    step = rank.schedule()
    assert step.scheduled == {long: 16} and step.decode_tokens() == 0  # no budget left for the second one
    assert step.prefill_tokens() == 16
    assert rank.complete(step) == [] and long.num_computed == 16
    step, _ = run_step(rank)
    assert step.scheduled == {long: 16}
    step = rank.schedule()
    assert step.scheduled == {long: 8, short: 5}  # the last chunk, and the next prompt fits beside it
    assert step.prefill_tokens() == 2 * ((40 + 5) // 2 - (32 + 0) // 2)  # 12: Dynamo's integer means of 13
    assert rank.complete(step) == [long, short]


def test_a_prompt_waits_until_the_blocks_of_all_its_tokens_fit_though_it_computes_a_chunk_at_a_time() -> None:
    # As Dynamo 1.6.1's mocker admits under v1 too (vLLM v1 itself admits by the first chunk's blocks).
    rank = scheduler(num_gpu_blocks=8, max_num_batched_tokens=8, enable_prefix_caching=False)
    running = sequence(list(range(8)), max_tokens=2)
    rank.add(running)
    run_step(rank)  # its prompt: 2 blocks
    long = sequence(list(range(100, 128)))  # 7 blocks
    rank.add(long)
    step, _ = run_step(rank)  # `running` takes a 3rd block for its 9th token: 5 are free, room for a chunk
    assert step.scheduled == {running: 1} and list(rank.waiting) == [long]
    step, _ = run_step(rank)  # `running` ended: all 8 blocks are free
    assert step.scheduled == {long: 8} and long.blocks.count == 2  # given only its chunk's blocks
    assert rank.preemptions == 0


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    rank = scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    first, second = sequence(list(range(12))), sequence(list(range(100, 110)))
    rank.add(first)
    rank.add(second)
    step, _ = run_step(rank)
    assert step.scheduled == {first: 12}
    step, _ = run_step(rank)
    assert step.scheduled == {first: 1, second: 10}
    with pytest.raises(EngineError, match="enable_chunked_prefill is off"):
        rank.add(sequence(list(range(17))))


def test_a_repeated_prompt_starts_after_its_cached_blocks() -> None:
    rank = scheduler()
    prompt = list(range(10))
    first = sequence(prompt, max_tokens=1)
    rank.add(first)
    run_step(rank)
    again = sequence(prompt, max_tokens=1)
    rank.add(again)
    step, _ = run_step(rank)
    assert again.cached_tokens == 8 and step.scheduled == {again: 2}
    assert rank.stats.hit_rate == pytest.approx(8 / 20)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    rank = scheduler()
    prompt = list(range(8))
    rank.add(sequence(prompt, max_tokens=1))
    run_step(rank)
    again = sequence(prompt, max_tokens=1)
    rank.add(again)
    step, _ = run_step(rank)
    assert again.cached_tokens == 4 and step.scheduled == {again: 4}


def test_running_out_of_blocks_preempts_the_newest_back_to_the_front_of_the_queue() -> None:
    rank = scheduler(num_gpu_blocks=4, enable_prefix_caching=False)
    old, new = sequence(list(range(8)), max_tokens=6), sequence(list(range(100, 108)), max_tokens=6)
    rank.add(old)
    rank.add(new)
    step, _ = run_step(rank)  # 2 + 2 blocks: the cache is full
    assert set(step.scheduled) == {old, new} and rank.cache.active_blocks == 4
    step, _ = run_step(rank)  # `old` needs a third block for its 9th token: `new` makes room
    assert step.scheduled == {old: 1}
    assert list(rank.waiting) == [new] and new.num_computed == 0 and new.blocks.count == 0
    assert rank.preemptions == 1
    for _ in range(4):
        run_step(rank)
    assert old.done and len(old.output) == 6
    assert rank.running == [] and list(rank.waiting) == [new]
    step = rank.schedule()
    assert step.scheduled == {new: 9}  # its prompt and its first token, computed again
    assert step.prefill_tokens() == 8  # the recomputed output token costs budget, not prefill time
    rank.complete(step)
    while rank.has_work:
        run_step(rank)
    assert new.done and len(new.output) == 6


def test_fifo_preemption_takes_the_oldest_and_gives_back_its_budget() -> None:
    rank = scheduler(num_gpu_blocks=4, enable_prefix_caching=False, preemption_mode="fifo")
    old, new = sequence(list(range(7)), max_tokens=10), sequence(list(range(100, 108)), max_tokens=10)
    rank.add(old)
    rank.add(new)
    run_step(rank)
    step, _ = run_step(rank)  # `old` stays within its blocks; `new` needs a third: `old` is preempted
    assert step.scheduled == {new: 1}
    assert list(rank.waiting) == [old]


def test_a_sequence_that_outgrew_the_cache_alone_fails_instead_of_waiting_forever() -> None:
    rank = scheduler(num_gpu_blocks=2, enable_prefix_caching=False)
    seq = sequence(list(range(8)), max_tokens=5)
    rank.add(seq)
    touched: list[Sequence] = []
    while rank.has_work:
        touched += run_step(rank)[1]
    assert seq.done and seq.finish_reason == "error"
    assert seq.error is not None and "more than the KV cache" in seq.error
    assert seq in touched


def test_a_prompt_larger_than_the_cache_is_refused_at_once() -> None:
    rank = scheduler(num_gpu_blocks=4)
    with pytest.raises(EngineError, match="needs 5 KV blocks"):
        rank.add(sequence(list(range(17))))
    with pytest.raises(EngineError, match="at least one token"):
        rank.add(sequence([]))


def test_a_stopped_sequence_is_dropped_and_its_blocks_freed_at_the_next_step() -> None:
    rank = scheduler()
    seq = sequence(list(range(10)), max_tokens=100)
    rank.add(seq)
    run_step(rank)
    seq.stop.stopped = True
    step, touched = run_step(rank)
    assert step.scheduled == {} and touched == [seq]
    assert seq.finish_reason == "cancelled" and rank.cache.active_blocks == 0


def test_abort_frees_a_sequence_at_once_even_in_the_middle_of_a_step() -> None:
    rank = scheduler()
    seq = sequence(list(range(10)), max_tokens=100)
    rank.add(seq)
    step = rank.schedule()
    rank.abort(seq)
    assert rank.cache.active_blocks == 0 and not rank.has_work
    assert rank.complete(step) == []
    assert seq.output == []


def test_output_tokens_are_deterministic_in_the_vocabulary_and_never_an_end() -> None:
    def generate(seed_seq: Sequence) -> list[int]:
        return [seed_seq.next_token() for _ in range(2000)]

    tokens = generate(Sequence("a", [1], 1, seed=7, vocab_size=50, stop=Flag(), eos_token_ids=[3, 4]))
    again = generate(Sequence("a", [1], 1, seed=7, vocab_size=50, stop=Flag(), eos_token_ids=[3, 4]))
    assert tokens == again
    assert set(tokens) <= set(range(50)) - {3, 4}
    assert len(set(tokens)) > 40


def test_blocks_filled_by_generated_tokens_are_named_by_the_whole_sequence() -> None:
    rank = scheduler()
    seq = sequence(list(range(6)), max_tokens=3)
    rank.add(seq)
    while rank.has_work:
        run_step(rank)
    tokens = seq.tokens(0, 8)
    assert tokens == [*range(6), *seq.output[:2]]
    assert seq.block_hashes == sequence_block_hashes(tokens, BLOCK)
    assert rank.cache.prefix_hit(seq.block_hashes, 2) == (2, 2)


def test_blocks_are_named_when_the_step_that_computes_them_is_scheduled() -> None:
    rank = scheduler(max_num_batched_tokens=8)
    seq = sequence(list(range(20)), max_tokens=1)
    rank.add(seq)
    rank.cache.record_events = True
    rank.schedule()  # the first chunk of 8 tokens: its 2 blocks are cached before the step runs, as vLLM does
    assert rank.cache.prefix_hit(seq.block_hashes, 5) == (2, 0)
    [stored] = rank.cache.take_events()
    assert stored.block_hashes == seq.block_hashes[:2]  # type: ignore[union-attr]


def test_a_prompt_admitted_in_the_same_step_shares_the_blocks_the_first_one_computes() -> None:
    rank = scheduler()
    system = list(range(100, 112))  # 3 full blocks both prompts start with
    first, second = sequence([*system, 1, 2]), sequence([*system, 3, 4])
    rank.add(first)
    rank.add(second)
    step = rank.schedule()
    assert step.scheduled == {first: 14, second: 2}  # one forward pass computes the shared blocks once
    assert (first.cached_tokens, second.cached_tokens) == (0, 12)
    assert rank.cache.active_blocks == 3 + 1 + 1  # the shared blocks and each one's last partial block


def test_a_sequence_preempted_while_scheduled_leaves_no_block_it_never_computed() -> None:
    rank = scheduler(num_gpu_blocks=4, preemption_mode="fifo")
    old, new = sequence(list(range(7)), max_tokens=10), sequence(list(range(100, 108)), max_tokens=10)
    rank.add(old)
    rank.add(new)
    run_step(rank)
    named = rank.cache.cached_blocks
    step, _ = run_step(rank)  # `old` is scheduled for its 8th token, then preempted to give `new` a block
    assert step.scheduled == {new: 1} and list(rank.waiting) == [old]
    # `old` never computed the token that fills its second block: that block was not named.
    assert rank.cache.prefix_hit(old.block_hashes, 2) == (1, 1)
    assert rank.cache.cached_blocks == named
