"""Predicting the next interval's request rate and lengths."""

import random
import statistics

import pytest

from planner import Planner
from planner.predict import ConstantPredictor, TrendPredictor
from tests.planner.factories import flat_profile, group, observation, targets


def test_the_trend_predictor_follows_a_ramp_one_step_ahead() -> None:
    predictor = TrendPredictor()
    for step in range(1, 13):
        predictor.observe(10.0 + 2.0 * step)
    predicted = predictor.predict()
    assert predicted is not None
    assert 34.0 < predicted <= 36.5  # the last value was 34, the next is 36


def test_the_constant_predictor_repeats_the_last_value() -> None:
    predictor = ConstantPredictor()
    assert predictor.predict() is None
    for value in (3.0, 9.0, 4.0):
        predictor.observe(value)
    assert predictor.predict() == 4.0


def test_the_trend_predictor_smooths_noise_around_a_steady_level() -> None:
    rng = random.Random(7)
    predictor = TrendPredictor()
    errors = []
    for _ in range(200):
        value = 10.0 + rng.gauss(0, 1)
        predicted = predictor.predict()
        if predicted is not None:
            errors.append(abs(predicted - 10.0))
        predictor.observe(value)
    assert sum(errors[20:]) / len(errors[20:]) < 1.0


def test_the_trend_predictor_never_predicts_below_zero() -> None:
    predictor = TrendPredictor()
    for value in (40.0, 20.0, 5.0, 0.0):
        predictor.observe(value)
    assert predictor.predict() == 0.0


def test_on_a_ramp_sla_mode_sizes_for_the_next_interval_not_the_last() -> None:
    # The rate climbs 2 req/s per interval; at 28 req/s observed, the trend predicts about 30: 3 prefill replicas
    # by the flat profile's 10 req/s each, where the last value alone (28 req/s) would still say 3, and at 30
    # observed the trend asks for 4 before the constant predictor would.
    trend, constant = Planner("trend"), Planner("constant")
    for step, rate in enumerate(range(10, 32, 2)):
        obs = observation(group("prefill", 3), rate=float(rate))
        (by_trend,) = trend.decide(float(step * 10), targets(predictor="trend"), obs, flat_profile())
        (by_constant,) = constant.decide(float(step * 10), targets(predictor="constant"), obs, flat_profile())
    assert rate == 30
    assert by_constant.desired == 3
    assert by_trend.desired == 4
    demand = trend.demand()
    assert demand is not None and 31.0 < demand.request_rate <= 32.5


def test_each_predictor_says_how_much_of_an_intervals_noise_reaches_its_forecast() -> None:
    assert ConstantPredictor().noise_factor == 1.0
    trend = TrendPredictor()
    # Measured: the forecast's variance over many steady intervals of independent unit noise.
    rng = random.Random(7)
    forecasts = []
    for _ in range(50_000):
        trend.observe(rng.gauss(0.0, 1.0) + 100.0)
        forecasts.append(trend.predict() or 0.0)
    measured = statistics.pvariance(forecasts[100:])
    assert trend.noise_factor == pytest.approx(measured, rel=0.05)
    assert 0.8 < trend.noise_factor < 0.9  # the default gains smooth a little
    assert TrendPredictor(0.3, 0.1).noise_factor < 0.3  # slower gains, much more
