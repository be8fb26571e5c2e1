"""Predicting the next interval's load from the last ones.

The reference (Dynamo's planner) offers ``constant`` (the last value), ARIMA (pmdarima), Prophet and a
Kalman filter on a local linear trend. Here there are two, without dependencies:

* ``constant``: the last value. Reacts within one interval, never anticipates.
* ``trend`` (default): Holt's double exponential smoothing, a level and a slope each smoothed
  exponentially (the same local-linear-trend model the reference's Kalman filter assumes, with fixed gains).
  On a ramp it predicts the next step rather than the last one; on noise it smooths. The slope is damped,
  so one jump is not extrapolated for long, and the prediction never falls below zero.
"""

import functools
from typing import Protocol

from planner.settings import PredictorName


class Predictor(Protocol):
    """One series (request rate, mean ISL or mean OSL), one value per interval."""

    #: The forecast's variance over one observation's, for independent noise on steady values: how much of
    #: an interval's noise reaches the prediction (1: all of it; a smoothing predictor passes less).
    noise_factor: float

    def observe(self, value: float) -> None: ...

    def predict(self) -> float | None:
        """The next interval's value (None: nothing observed yet)."""
        ...


class ConstantPredictor:
    """The next value is the last one."""

    noise_factor = 1.0

    def __init__(self) -> None:
        self._last: float | None = None

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self) -> float | None:
        return self._last


class TrendPredictor:
    """Holt's linear trend: ``level`` follows the values with gain ``alpha``, ``slope`` follows the level's
    change with gain ``beta``, damped by ``damping`` per step; the forecast is one step ahead."""

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, damping: float = 0.95) -> None:
        self.alpha, self.beta, self.damping = alpha, beta, damping
        self._level: float | None = None
        self._slope = 0.0
        self.noise_factor = _holt_noise_factor(alpha, beta, damping)

    def observe(self, value: float) -> None:
        if self._level is None:
            self._level = value
            return
        expected = self._level + self.damping * self._slope
        level = self.alpha * value + (1 - self.alpha) * expected
        self._slope = self.beta * (level - self._level) + (1 - self.beta) * self.damping * self._slope
        self._level = level

    def predict(self) -> float | None:
        if self._level is None:
            return None
        return max(0.0, self._level + self.damping * self._slope)


@functools.cache
def _holt_noise_factor(alpha: float, beta: float, damping: float, steps: int = 2000) -> float:
    """The sum of the squared weights Holt's forecast gives past observations (its response to one impulse):
    the forecast's variance over an observation's, for independent noise (0.6/0.4 damped 0.95: 0.84; 0.3/0.1: 0.24)."""
    # The state just after an impulse of 1 observed on a level of 0.
    level, slope, total = alpha, beta * alpha, 0.0
    for _ in range(steps):
        forecast = level + damping * slope
        total += forecast * forecast
        new_level = (1 - alpha) * forecast
        slope = beta * (new_level - level) + (1 - beta) * damping * slope
        level = new_level
    return total


def make_predictor(name: PredictorName) -> Predictor:
    """A new predictor of the named kind."""
    return ConstantPredictor() if name == "constant" else TrendPredictor()
