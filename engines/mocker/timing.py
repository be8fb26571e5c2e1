"""How long a simulated step takes: the polynomials of NVIDIA Dynamo's mocker, so the two compare.

A step is timed as Dynamo 1.6.1's vLLM mocker times it: the step's prefill costs ``prefill_ms`` of
all the tokens it computes, summed over its sequences (chunks, or whole uncached prompts) — one
forward pass, so the fixed part is paid once per step, not once per sequence — and, when a sequence
past its prefill produces a token in the step, one decode pass costs ``decode_ms`` of the KV usage (a
prefill's last chunk gives its sequence's first token by itself). Measured against Dynamo's own mocker
(bench/burst_ttft.py): a burst of eight 3000-token prompts on one worker gives the same first-token
times step by step (e.g. 68, 244, 422 ms). Prefill time is divided by
``speedup_ratio``; decode time by ``speedup_ratio × decode_speedup_ratio``. A ratio of 0 means no
waiting at all.
"""

from collections.abc import Iterable

from engines.mocker.config import MockerConfig

# Fitted by Dynamo's mocker to a real engine's profile (ms against new tokens, and against KV usage).
_PREFILL_A, _PREFILL_B, _PREFILL_C = 4.209989e-07, 1.518344e-02, 1.650142e01
_DECODE_A, _DECODE_B, _DECODE_C = -25.74, 54.01, 5.74
_MIN_DECODE_MS = 1.0


def prefill_ms(new_tokens: int) -> float:
    """Milliseconds to prefill ``new_tokens`` tokens of one sequence (0 for none)."""
    if new_tokens <= 0:
        return 0.0
    return (_PREFILL_A * new_tokens + _PREFILL_B) * new_tokens + _PREFILL_C


def decode_ms(kv_usage: float) -> float:
    """Milliseconds of one decode pass when ``kv_usage`` (0..1) of the KV blocks are in use."""
    usage = min(max(kv_usage, 0.0), 1.0)
    return max(_MIN_DECODE_MS, (_DECODE_A * usage + _DECODE_B) * usage + _DECODE_C)


class StepTimer:
    """Seconds of simulated time for a step, with the config's speed-ups applied."""

    __slots__ = ("_decode_scale", "_prefill_scale")

    def __init__(self, config: MockerConfig) -> None:
        # Seconds per simulated millisecond; 0 when a ratio of 0 asks for no waiting.
        speedup = config.speedup_ratio
        self._prefill_scale = 0.0 if speedup == 0 else 1e-3 / speedup
        decode_speedup = speedup * config.decode_speedup_ratio
        self._decode_scale = 0.0 if decode_speedup == 0 else 1e-3 / decode_speedup

    def step_seconds(self, prefill_chunks: Iterable[int], decoding: bool, kv_usage: float) -> float:
        """The step's duration: one prefill of all its chunks' tokens, plus one decode pass if ``decoding``."""
        seconds = 0.0
        if self._prefill_scale:
            seconds = prefill_ms(sum(prefill_chunks)) * self._prefill_scale
        if decoding and self._decode_scale:
            seconds += decode_ms(kv_usage) * self._decode_scale
        return seconds
