"""How closely the mocker's tokens follow its simulated time: timerfd sleeps against asyncio.sleep.

Runs the mocker engine in this process (under uvloop, as ``flotilla run`` does) and streams
``--requests`` requests of ``--prompt`` fresh tokens for ``--tokens`` tokens each, one at a time, so
every step decodes one sequence. Each gap between two tokens should last the step that made the
second one (timing.py's decode time for the KV usage then); the script records every step's simulated
duration and prints, per way of sleeping, how far the gaps stray from them: the median and p90 of
|gap - step|, and the median gap against the median step. The baseline, measured in the same run,
is the engine with its timerfd closed, which sleeps with asyncio.sleep on the loop's millisecond
timers (engines/mocker/precise_sleep.py says why that is coarse).

    .venv/bin/python bench/mocker_step_precision.py [--requests 20] [--tokens 40] [--prompt 4500] [--speedup 1]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.mocker.config import MockerConfig  # noqa: E402
from engines.mocker.engine import MockerEngine  # noqa: E402
from engines.mocker.timing import StepTimer  # noqa: E402
from runtime.engine import RequestContext  # noqa: E402
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402


class RecordingTimer:
    """The engine's StepTimer, keeping every step's simulated seconds in order."""

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self.steps: list[float] = []

    def step_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        seconds = self._timer.step_seconds(prefill_tokens, decode_tokens)
        self.steps.append(seconds)
        return seconds


async def measure(arguments: argparse.Namespace, *, precise: bool) -> tuple[list[float], list[float]]:
    """(gap - step) in seconds for every token after the first, and the gaps themselves."""
    config = MockerConfig(speedup_ratio=arguments.speedup, num_gpu_blocks=8192, block_size=64)
    engine = MockerEngine(config, vocab_size=49152)
    timer = RecordingTimer(engine._timer)
    engine._timer = timer  # type: ignore[assignment]  # same method, recorded
    await engine.start()
    if not precise:
        for rank in engine._ranks:
            rank.sleeper.close()  # back to asyncio.sleep
    errors: list[float] = []
    gaps: list[float] = []
    try:
        for number in range(arguments.requests):
            request = PreprocessedRequest(
                request_id=f"precision-{number}",
                model="mocker",
                token_ids=[1000 + (number * 7919 + offset) % 39000 for offset in range(arguments.prompt)],
                sampling=SamplingOptions(),
                stop_conditions=StopConditions(max_tokens=arguments.tokens, ignore_eos=True),
            )
            timer.steps.clear()
            arrivals = []
            async for _ in engine.generate(request, RequestContext(request.request_id)):
                arrivals.append(time.perf_counter())
            # Step 0 is the prefill (the first token); step k > 0 made token k.
            for index in range(1, len(arrivals)):
                gap = arrivals[index] - arrivals[index - 1]
                gaps.append(gap)
                errors.append(gap - timer.steps[index])
    finally:
        await engine.close()
    return errors, gaps


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=40, help="output tokens per request")
    parser.add_argument("--prompt", type=int, default=4500, help="prompt tokens per request (fresh ids each)")
    parser.add_argument("--speedup", type=float, default=1.0, help="the mocker's speedup_ratio")
    arguments = parser.parse_args()
    if arguments.requests < 1 or arguments.tokens < 2 or arguments.prompt < 1 or arguments.speedup <= 0:
        parser.error("--requests and --prompt must be at least 1, --tokens at least 2, --speedup above 0")
    print(
        f"{arguments.requests} requests x {arguments.tokens} tokens, prompt {arguments.prompt}, "
        f"speedup {arguments.speedup:g}, one at a time; times in ms"
    )
    print(f"{'sleep':<14}{'|gap-step| p50':>16}{'p90':>8}{'gap p50':>9}{'step p50':>10}")
    results = {}
    for name, precise in (("asyncio.sleep", False), ("timerfd", True)):
        errors, gaps = uvloop.run(measure(arguments, precise=precise))
        steps = [gap - error for gap, error in zip(gaps, errors, strict=True)]
        deviation = [abs(error) * 1000 for error in errors]
        results[name] = statistics.median(deviation)
        print(
            f"{name:<14}{results[name]:>16.3f}{percentile(deviation, 0.9):>8.3f}"
            f"{statistics.median(gaps) * 1000:>9.3f}{statistics.median(steps) * 1000:>10.3f}"
        )
    print(f"timerfd / asyncio.sleep, median |gap - step|: {results['timerfd'] / results['asyncio.sleep']:.2f}")


if __name__ == "__main__":
    main()
