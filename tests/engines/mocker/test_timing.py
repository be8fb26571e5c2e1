"""The step timing model: Dynamo's mocker polynomials, summed per step, divided by the speed-ups."""

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.timing import StepTimer, decode_ms, prefill_ms


def test_prefill_grows_with_the_new_tokens_as_dynamos_polynomial() -> None:
    assert prefill_ms(0) == 0.0
    assert prefill_ms(1000) == pytest.approx(4.209989e-07 * 1000**2 + 1.518344e-02 * 1000 + 16.50142)
    assert prefill_ms(8192) == pytest.approx(4.209989e-07 * 8192**2 + 1.518344e-02 * 8192 + 16.50142)


def test_decode_grows_with_kv_usage_and_never_drops_below_a_millisecond() -> None:
    assert decode_ms(0.0) == pytest.approx(5.74)
    assert decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert decode_ms(1.0) == pytest.approx(-25.74 + 54.01 + 5.74)
    assert decode_ms(2.0) == decode_ms(1.0)  # usage is clamped to 0..1
    assert decode_ms(-1.0) == decode_ms(0.0)


def test_a_mixed_step_is_one_prefill_of_its_prompt_tokens_and_one_decode_pass_of_its_decoders_lengths() -> None:
    config = MockerConfig(num_gpu_blocks=1000, block_size=16)  # 16,000 tokens of capacity
    timer = StepTimer(config)
    seconds = timer.step_seconds(prefill_tokens=2100, decode_tokens=4000)
    # One forward pass for the step's prompt tokens together (the fixed part once), and the decode pass
    # by the decoding sequences' summed lengths over the capacity, as Dynamo 1.6.1's mocker times them.
    assert seconds == pytest.approx((prefill_ms(2100) + decode_ms(0.25)) / 1000)
    assert timer.step_seconds(prefill_tokens=500, decode_tokens=0) == pytest.approx(prefill_ms(500) / 1000)
    # Lengths past the capacity (a shared prefix counts once per sequence) cost what a full cache does.
    assert timer.step_seconds(prefill_tokens=0, decode_tokens=50_000) == pytest.approx(decode_ms(1.0) / 1000)


def test_speedups_divide_the_time() -> None:
    timer = StepTimer(MockerConfig(speedup_ratio=100, decode_speedup_ratio=2))
    assert timer.step_seconds(64, 0) == pytest.approx(prefill_ms(64) / 1000 / 100)
    assert timer.step_seconds(0, 1) == pytest.approx(decode_ms(0) / 1000 / 200, rel=1e-3)


def test_a_speedup_of_zero_means_no_waiting() -> None:
    assert StepTimer(MockerConfig(speedup_ratio=0)).step_seconds(4000, 5000) == 0.0
    decode_free = StepTimer(MockerConfig(decode_speedup_ratio=0))
    assert decode_free.step_seconds(0, 5000) == 0.0
