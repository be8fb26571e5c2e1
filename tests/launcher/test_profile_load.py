"""`flotilla profile`'s load on a real (simulated) engine: the mocker, in this process."""

import asyncio

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.engine import MockerEngine
from engines.mocker.timing import decode_ms, prefill_ms
from launcher.profile_load import Prompts, measure_decode, measure_prefill, sweep_lengths, warm_up
from launcher.profile_sweep import Point, TimeScale

# Measured latencies and rates compared with the timing model's: a loaded CPU would stretch them.
serial = pytest.mark.serial


async def _measure(speedup: float) -> tuple[Point, Point]:
    engine = MockerEngine(MockerConfig(speedup_ratio=speedup), vocab_size=1000)
    await engine.start()
    try:
        prompts = Prompts(1000)
        await warm_up(engine, prompts, 512)
        scale = TimeScale(speedup)
        # Medians: a stall of the process (another on the same cores) holds up every request in flight, and
        # at speed-up 10 counts ten times over; it moves a p90 of 16 requests, rarely their median.
        prefill = await measure_prefill(engine, prompts, 512, 4, percent=50, scale=scale)
        decode = await measure_decode(engine, prompts, 128, 4, percent=50, scale=scale)
        return prefill, decode
    finally:
        await engine.close()


@serial
def test_a_point_measured_at_speed_up_10_equals_the_same_point_at_speed_up_1() -> None:
    slow_prefill, slow_decode = asyncio.run(_measure(1.0))
    fast_prefill, fast_decode = asyncio.run(_measure(10.0))
    # Within 15%: the CPU's own time (not scaled down by the speed-up) is small against a simulated step.
    for slow, fast in ((slow_prefill, fast_prefill), (slow_decode, fast_decode)):
        assert fast.tokens_per_s == pytest.approx(slow.tokens_per_s, rel=0.15)
        assert fast.latency_s == pytest.approx(slow.latency_s, rel=0.15)


@serial
def test_the_measured_points_are_those_of_the_mockers_timing_model() -> None:
    prefill, decode = asyncio.run(_measure(10.0))
    # Four prompts of 512 computed in one step of 2048 tokens: each waits that step.
    assert prefill.latency_s == pytest.approx(prefill_ms(2048) / 1000, rel=0.2)
    # Four sequences decoding a few hundred tokens of a 1M-token cache: about the smallest decode pass.
    assert decode.latency_s == pytest.approx(decode_ms(4 * 128 / (16384 * 64)) / 1000, rel=0.2)
    assert decode.tokens_per_s == pytest.approx(4 / (decode_ms(0.0005) / 1000), rel=0.2)


def test_prompts_are_distinct_so_no_prefix_is_found_in_the_cache() -> None:
    prompts = Prompts(49152)
    first, second = prompts.request(256, 1), prompts.request(256, 1)
    assert first.token_ids[:64] != second.token_ids[:64]
    assert first.request_id != second.request_id
    assert all(24576 <= token < 49151 for token in first.token_ids)


@serial
def test_a_length_sweep_stops_at_its_first_point_over_the_target() -> None:
    reported: list[tuple[int, bool]] = []

    async def sweep() -> dict[int, list[Point]]:
        engine = MockerEngine(MockerConfig(speedup_ratio=20.0), vocab_size=1000)
        await engine.start()
        prompts = Prompts(1000)
        try:
            await warm_up(engine, prompts, 2048)
            return await sweep_lengths(
                engine,
                prompts,
                "prefill",
                [2048],
                max_concurrency=64,
                # One prompt of 2048 takes ~50 ms, two ~87 ms: concurrency 2 is the first over 60 ms.
                target_s=0.06,
                percent=90,
                scale=TimeScale(20.0),
                report=lambda point, met: reported.append((point.concurrency, met)),
            )
        finally:
            await engine.close()

    measured = asyncio.run(sweep())
    assert reported == [(1, True), (2, False)]
    assert [point.concurrency for point in measured[2048]] == [1, 2]
