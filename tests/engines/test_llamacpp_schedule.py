"""The llama.cpp engine's decoding schedule: a prompt never with a lone token, migrated tokens one at a time,
a request to the slot that shares its prefix."""

import pytest

from engines.llamacpp.batch import Slot, choose_slot, take_chunk
from engines.llamacpp.engine import PrefillPlan, plan_prefill
from runtime.errors import EngineError

PROMPT = list(range(100, 110))


def test_a_cold_prompt_is_decoded_in_one_batch() -> None:
    assert plan_prefill([], PROMPT, 0, n_batch=512) == PrefillPlan(reuse=0, batches=[10])


def test_the_cached_prefix_is_reused_and_only_the_rest_is_decoded() -> None:
    assert plan_prefill([*PROMPT[:6], 1, 2], PROMPT, 0, n_batch=512) == PrefillPlan(6, [4])


def test_a_fully_cached_prompt_still_decodes_its_last_two_tokens_together() -> None:
    assert plan_prefill([*PROMPT, 1, 2], PROMPT, 0, n_batch=512) == PrefillPlan(8, [2])


def test_one_new_prompt_token_is_decoded_with_the_one_before_it() -> None:
    assert plan_prefill(PROMPT[:9], PROMPT, 0, n_batch=512) == PrefillPlan(8, [2])


def test_migrated_tokens_are_left_to_be_decoded_one_at_a_time() -> None:
    generated = [7, 8, 9]
    assert plan_prefill([], PROMPT + generated, 3, n_batch=512) == PrefillPlan(0, [10])
    # Even where the context holds them already: it may have decoded them in a batch.
    assert plan_prefill(PROMPT + generated, PROMPT + generated, 3, n_batch=512) == PrefillPlan(10, [])


def test_no_batch_is_a_single_token_when_the_prompt_spans_several() -> None:
    assert plan_prefill([], list(range(9)), 0, n_batch=4).batches == [4, 3, 2]
    assert plan_prefill([], list(range(8)), 0, n_batch=4).batches == [4, 4]


def test_a_one_token_prompt_is_decoded_alone() -> None:
    assert plan_prefill([5], [5], 0, n_batch=512) == PrefillPlan(0, [1])


def test_a_request_without_prompt_tokens_is_refused() -> None:
    with pytest.raises(EngineError, match="no prompt tokens"):
        plan_prefill([], [1, 2], 2, n_batch=512)


def test_a_prompt_chunk_never_leaves_a_lone_token_for_the_next() -> None:
    prompt = list(range(9))
    assert [len(take_chunk(prompt, 4)) for _ in range(3)] == [4, 3, 2]
    assert take_chunk([1, 2, 3], 512) == [1, 2, 3]


def test_a_request_goes_to_the_free_slot_with_the_longest_shared_prefix() -> None:
    slots = [Slot(0, [1, 2, 9]), Slot(1, [1, 2, 3, 4]), Slot(2, [1, 2, 3, 4, 5], busy=True)]
    assert choose_slot(slots, [1, 2, 3, 4, 5, 6]) is slots[1]


def test_without_a_shared_prefix_the_least_recently_used_free_slot_is_taken() -> None:
    slots = [Slot(0, [7], last_used=5), Slot(1, [8], last_used=2), Slot(2, [], last_used=9)]
    assert choose_slot(slots, [1, 2]) is slots[1]


def test_no_slot_is_chosen_while_all_are_busy() -> None:
    assert choose_slot([Slot(0, busy=True), Slot(1, busy=True)], [1]) is None
