"""How long a simulated step takes: the polynomials of NVIDIA Dynamo's mocker, so the two compare.

A step is timed as Dynamo 1.6.1's vLLM mocker (aisimulate-core 0.13.0, ``perf_model.rs`` and the vLLM
core's ``predict_prefill_duration`` / ``emit_ready_tokens``) times a pass:

* its prefill costs ``prefill_ms`` of the new prompt tokens of every sequence that computes some in the
  step, taken as Dynamo takes them: the number of such sequences times the integer mean of their prompt
  lengths so far less the integer mean of what they had computed before (``Step.prefill_tokens``) — one
  forward pass, so the fixed part is paid once per step. A preempted sequence's recomputed output tokens
  cost budget, not prefill time;
* when sequences past their prefill produce a token in the step, one decode pass costs ``decode_ms`` of
  their summed lengths (prompt and output, a shared prefix counted once per sequence) over the rank's
  token capacity (``num_gpu_blocks × block_size``), capped at 1. A prefill's last chunk gives its
  sequence's first token by itself: that sequence is not in the decode batch (measured on Dynamo 1.6.1's
  binary by bench/burst_ttft.py: this is the timing its first-token times fit).

Prefill time is divided by ``speedup_ratio``; decode time by ``speedup_ratio × decode_speedup_ratio``. A
ratio of 0 means no waiting at all (Dynamo's means real time: the benches refuse 0 for it).
"""

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
    """Milliseconds of one decode pass whose sequences' tokens fill ``kv_usage`` (0..1) of the KV capacity."""
    usage = min(max(kv_usage, 0.0), 1.0)
    return max(_MIN_DECODE_MS, (_DECODE_A * usage + _DECODE_B) * usage + _DECODE_C)


class StepTimer:
    """Seconds of simulated time for a step, with the config's speed-ups applied."""

    __slots__ = ("_capacity", "_decode_scale", "_prefill_scale")

    def __init__(self, config: MockerConfig) -> None:
        # Seconds per simulated millisecond; 0 when a ratio of 0 asks for no waiting.
        speedup = config.speedup_ratio
        self._prefill_scale = 0.0 if speedup == 0 else 1e-3 / speedup
        decode_speedup = speedup * config.decode_speedup_ratio
        self._decode_scale = 0.0 if decode_speedup == 0 else 1e-3 / decode_speedup
        self._capacity = config.num_gpu_blocks * config.block_size

    def step_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        """The step's duration: one prefill of ``prefill_tokens`` new prompt tokens (``Step.prefill_tokens``),
        plus, when ``decode_tokens`` (the decoding sequences' summed lengths) is above 0, one decode pass."""
        seconds = 0.0
        if self._prefill_scale:
            seconds = prefill_ms(prefill_tokens) * self._prefill_scale
        if decode_tokens > 0 and self._decode_scale:
            seconds += decode_ms(decode_tokens / self._capacity) * self._decode_scale
        return seconds
