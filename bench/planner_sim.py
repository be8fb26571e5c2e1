"""The planner on planner_ramp.py's ramp in simulated time: what its worker-seconds floor asks of any planner.

    .venv/bin/python bench/planner_sim.py [--rate 2.54] [--interval 3] [--seeds 30] [--ramp-s 180]

``bench/planner_ramp.py`` runs the planner on a live fleet, a few minutes a run, and its worker-seconds move
with the arrivals' noise. This script replays the same ramp without a fleet: for each seed it draws the
ramp's Poisson arrivals (the same generator and shape, one worker's rate ``--rate`` as 1×, the profile
the live bench PUTs for it), gives the planner each interval's observed request rate, and takes its
decisions as the replica count at once (no start-up or drain time, which the live bench also counts, and
no latency: the SLA sizing runs on the profile alone). Rows:

* **the bench's settings**: the trend predictor and the live bench's stability windows;
* **constant predictor**: the last interval's rate;
* **noise tolerance Z** (``--noise-tolerances``): the bench's settings with ``stability.noise_tolerance`` Z,
  growth waiting until the need is over the replicas with the rate Z standard errors lower;
* **trend A/B** (``--trend-gains``): Holt's predictor with other gains (level ``A``, slope ``B``; the
  planner's are 0.6/0.4), to show what smoothing the arrivals' noise trades;
* **oracle**: the planner told the offered rate itself (no arrival noise), through the same sizing and
  bounds;
* **ceil(load)**: the offered load rounded up, moment by moment, with no planner at all.

Each row gives worker-seconds as a share of a static provisioning for the peak (4 workers throughout; the
floor is <= 0.7), median and range over the seeds, and the seconds during which fewer replicas were asked
for than the offered load's worth (the TTFT floor's risk).
"""

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from planner_ramp import PEAK, arrivals, multiplier, profile_for  # noqa: E402

from planner.core import Planner  # noqa: E402
from planner.observation import GroupObservation, Observation  # noqa: E402
from planner.predict import Predictor, TrendPredictor  # noqa: E402
from planner.profile import Profile  # noqa: E402
from planner.settings import GroupTargets, PredictorName, Stability, Targets  # noqa: E402

ISL, OSL = 4096, 16


class _GainsPlanner(Planner):
    """The planner with Holt's predictor at other gains (``Planner`` makes them with fixed ones)."""

    def __init__(self, gains: tuple[float, float]) -> None:
        self._gains = gains
        super().__init__("trend")

    def _predictors(self) -> tuple[Predictor, Predictor, Predictor]:
        alpha, beta = self._gains
        return TrendPredictor(alpha, beta), TrendPredictor(alpha, beta), TrendPredictor(alpha, beta)


@dataclass(frozen=True)
class Outcome:
    share: float  # worker-seconds / static provisioning for the peak
    short_s: float  # seconds with fewer replicas asked for than the offered load's worth


def simulate(
    rate: float,
    args: argparse.Namespace,
    seed: int,
    predictor: PredictorName = "trend",
    observed: Callable[[list[float], float, float], float] | None = None,
    gains: tuple[float, float] | None = None,
    tolerance: float = 0.0,
) -> Outcome:
    """One ramp: the planner decides every interval on what ``observed`` says of it (default: the arrivals
    counted over the interval, as the ingress's histograms count requests)."""
    duration, interval = args.ramp_s, args.interval
    times = arrivals(lambda t: rate * multiplier(t, duration), rate * PEAK, duration, seed=seed)
    count = observed or (lambda times, start, end: sum(1 for t in times if start <= t < end) / (end - start))
    targets = Targets(
        default=GroupTargets(ttft_s=1.0, itl_s=0.25),
        predictor=predictor,
        stability=Stability(
            cooldown_s=interval,
            reversal_s=args.reversal,
            down_window_s=args.down_window,
            noise_tolerance=tolerance,
        ),
    )
    profile = Profile.from_dict(profile_for(rate, ISL, OSL, 1.0, 0.25))
    planner = Planner(predictor) if gains is None else _GainsPlanner(gains)
    replicas, now, used, short = 1, 0.0, 0.0, 0.0
    while now < duration:
        request_rate = count(times, now, now + interval)
        observation = Observation(
            interval, request_rate, ISL, OSL, groups=(GroupObservation("aggregated", replicas, 1),)
        )
        used += replicas * interval
        if multiplier(now + interval / 2, duration) > replicas + 1e-9:
            short += interval
        now += interval
        [decision] = planner.decide(now, targets, observation, profile)
        replicas = decision.desired
    return Outcome(used / (math.ceil(PEAK) * duration), short)


def ceil_load(args: argparse.Namespace) -> Outcome:
    """The offered load rounded up at every instant (0.1 s steps): no planner, no noise, no lag."""
    step, used, t = 0.1, 0.0, 0.0
    while t < args.ramp_s:
        used += math.ceil(multiplier(t + step / 2, args.ramp_s) - 1e-9) * step
        t += step
    return Outcome(used / (math.ceil(PEAK) * args.ramp_s), 0.0)


def show(name: str, outcomes: list[Outcome]) -> None:
    shares = [o.share for o in outcomes]
    shorts = [o.short_s for o in outcomes]
    print(
        f"{name:<28}{statistics.median(shares):>8.3f}   [{min(shares):.3f} .. {max(shares):.3f}]"
        f"{statistics.median(shorts):>10.0f} s   (max {max(shorts):.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.54, help="1x: one worker's requests/s (the live sweep's)")
    parser.add_argument("--interval", type=float, default=3.0, help="the planner's interval, seconds")
    parser.add_argument("--reversal", type=float, default=12.0, help="stability.reversal_s (the live bench's)")
    parser.add_argument("--down-window", type=float, default=9.0, help="stability.down_window_s (the live bench's)")
    parser.add_argument("--ramp-s", type=float, default=180.0)
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument(
        "--trend-gains", default="0.4/0.2,0.3/0.1", help="other gains of Holt's predictor to try, LEVEL/SLOPE,..."
    )
    parser.add_argument(
        "--noise-tolerances", default="1,1.5", help="stability.noise_tolerance values to try, comma-separated"
    )
    args = parser.parse_args()
    seeds = range(1, args.seeds + 1)
    rate = args.rate

    def offered(_times: list[float], start: float, end: float) -> float:
        return rate * multiplier((start + end) / 2, args.ramp_s)

    print(f"ramp 1x -> 4x -> 1x over {args.ramp_s:g} s at 1x = {rate:g} req/s, {args.seeds} arrival seeds")
    print(f"{'':<28}{'worker-seconds / static peak':>30}{'short of the load':>22}")
    show("the bench's settings", [simulate(rate, args, seed) for seed in seeds])
    show("constant predictor", [simulate(rate, args, seed, predictor="constant") for seed in seeds])
    for tolerance in (float(x) for x in filter(None, args.noise_tolerances.split(","))):
        outcomes = [simulate(rate, args, seed, tolerance=tolerance) for seed in seeds]
        show(f"noise tolerance {tolerance:g}", outcomes)
    for pair in filter(None, args.trend_gains.split(",")):
        alpha, beta = (float(x) for x in pair.split("/"))
        show(f"trend {alpha:g}/{beta:g}", [simulate(rate, args, seed, gains=(alpha, beta)) for seed in seeds])
    show("oracle (the offered rate)", [simulate(rate, args, 1, predictor="constant", observed=offered)])
    show("ceil(load), no planner", [ceil_load(args)])


if __name__ == "__main__":
    main()
