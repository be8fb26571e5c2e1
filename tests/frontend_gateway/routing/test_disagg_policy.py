"""Where a prompt is computed: Dynamo's ``isl_bounding`` rule, with its defaults (2048 tokens, 0.7)."""

import pytest

from frontend_gateway.routing.disagg_policy import DisaggMode, DisaggPolicy, prefill_busy

ISL = DisaggPolicy(mode=DisaggMode.ISL)


@pytest.mark.parametrize(
    ("prompt", "uncached", "where"),
    [
        (1000, 104, "isl"),  # a next turn: 14 of its blocks of 64 held by the decode worker
        (1000, 1000, None),  # nothing cached there: short as it is, 100% is left to compute
        (10_000, 2100, None),  # 21% left, but more than 2048 tokens of it
        (10_000, 2047, "isl"),
        (10_000, 2048, None),  # the threshold is exclusive, as Dynamo's `<`
        (1000, 699, "isl"),
        (1000, 700, None),  # so is the ratio
        (1, 1, None),
        (100, 0, "isl"),  # all of it cached
        (100, 500, None),  # an estimate above the prompt counts as all of it
    ],
)
def test_isl_keeps_a_prompt_local_when_little_of_it_is_left_to_compute(prompt: int, uncached: int, where: str) -> None:
    assert ISL.decide(prompt, uncached) == where


def test_always_and_load_send_every_prompt_to_a_prefill_worker_as_far_as_the_prompt_goes() -> None:
    assert DisaggPolicy().decide(1000, 0) is None
    assert DisaggPolicy(mode=DisaggMode.LOAD).decide(1000, 0) is None  # load looks at the prefill workers


@pytest.mark.parametrize(
    ("in_flight", "capacity", "share", "busy"),
    [
        (8192, 8192, 1.0, False),  # a full step's worth is not over it
        (8193, 8192, 1.0, True),
        (4097, 8192, 0.5, True),
        (10**9, None, 1.0, False),  # a worker that does not say its step is never busy (as in Dynamo)
        (0, 8192, 0.01, False),
    ],
)
def test_a_prefill_worker_is_busy_past_its_share_of_a_step(
    in_flight: int, capacity: int | None, share: float, busy: bool
) -> None:
    assert prefill_busy(in_flight, capacity, share) is busy


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="isl_ratio"):
        DisaggPolicy(isl_ratio=1.5)
    with pytest.raises(ValueError, match="isl_threshold"):
        DisaggPolicy(isl_threshold=-1)
    with pytest.raises(ValueError, match="prefill_busy"):
        DisaggPolicy(prefill_busy=0.0)
    with pytest.raises(ValueError, match="decode_busy"):
        DisaggPolicy(decode_busy=1.5)


@pytest.mark.parametrize(
    ("gate", "usage", "allowed"),
    [
        (None, None, True),  # no gate: the policy decides alone
        (None, 0.99, True),
        (0.8, 0.5, True),
        (0.8, 0.8, True),
        (0.8, 0.81, False),  # too full to take a prefill of its own
        (0.8, None, False),  # an unknown fill denies it, as in Dynamo
    ],
)
def test_the_decode_gate_vetoes_a_local_prefill_on_a_full_or_unknown_decode_worker(
    gate: float | None, usage: float | None, allowed: bool
) -> None:
    assert DisaggPolicy(mode=DisaggMode.ISL, decode_busy=gate).decode_allows_local(usage) is allowed
