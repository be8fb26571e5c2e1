"""Conditional disaggregation: whether a request's prompt is computed on a prefill worker or where it decodes.

A remote prefill pays when the prompt has much to compute: the decode worker then spends its steps on
decoding, not on a long prompt that would stall every stream it runs. For a short prompt, or one the decode
worker mostly holds in its cache already, the hop to a prefill worker and the KV transfer cost more than
they save. Dynamo's ``isl_bounding`` policy draws the line (``conditional_disagg.rs``), with its defaults:
local when the prompt tokens the decode worker still has to compute are under ``isl_threshold`` *and*
under ``isl_ratio`` of the prompt. Its ``prefill_load`` policy keeps a prompt local when the prefill
workers are busy: their prompt tokens in flight (from this ingress) over ``prefill_busy`` times the
tokens their engine computes in a step (``prefill_busy_share`` decides; models/remote_engines.py asks it).

``DisaggPolicy.decide`` is a pure function of the prompt and the decode router's decision; it returns the
reason for a local prefill, or None for a remote one. The other reasons a request is prefilled locally
(no prefill worker, every one busy, its prefill failed) are the remote engine's (models/remote_engines.py).
"""

import enum
from dataclasses import dataclass

# One set of defaults for a gateway's flags and a pipeline's settings (Dynamo's, for isl).
from runtime.fleet_contract.router_settings import DEFAULT_ISL_RATIO, DEFAULT_ISL_THRESHOLD, DEFAULT_PREFILL_BUSY

__all__ = [
    "DEFAULT_ISL_RATIO",
    "DEFAULT_ISL_THRESHOLD",
    "DEFAULT_PREFILL_BUSY",
    "DisaggMode",
    "DisaggPolicy",
    "prefill_busy",
]


class DisaggMode(enum.StrEnum):
    """``--disagg-policy``: ``always`` prefills every request remotely while a prefill worker is there;
    ``isl`` only those with much left to compute, ``load`` only while a prefill worker is not busy
    (``DisaggPolicy``)."""

    ALWAYS = "always"
    ISL = "isl"
    LOAD = "load"


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggPolicy:
    mode: DisaggMode = DisaggMode.ALWAYS
    #: ``isl``: a prompt with fewer tokens than this left to compute on its decode worker is computed there...
    isl_threshold: int = DEFAULT_ISL_THRESHOLD
    #: ...if they are also under this share of the prompt (a long prompt mostly cached there stays local).
    isl_ratio: float = DEFAULT_ISL_RATIO
    #: ``load``: a prefill worker with more prompt tokens in flight than this share of what its engine
    #: computes in a step is busy (Dynamo's ``prefill_busy_threshold``).
    prefill_busy: float = DEFAULT_PREFILL_BUSY
    #: The decode gate (Dynamo's ``decode_busy_threshold``): a prompt the policy would keep on its decode worker
    #: goes to a prefill worker all the same when that decode worker's KV cache is fuller than this (0..1), or
    #: its fill is unknown. None: no gate.
    decode_busy: float | None = None

    def __post_init__(self) -> None:
        if self.isl_threshold < 0:
            raise ValueError(f"isl_threshold must be >= 0, not {self.isl_threshold}")
        if not 0.0 <= self.isl_ratio <= 1.0:
            raise ValueError(f"isl_ratio must be between 0 and 1, not {self.isl_ratio}")
        if not self.prefill_busy > 0.0:
            raise ValueError(f"prefill_busy must be above 0, not {self.prefill_busy}")
        if self.decode_busy is not None and not 0.0 <= self.decode_busy <= 1.0:
            raise ValueError(f"decode_busy must be between 0 and 1, not {self.decode_busy}")

    def decode_allows_local(self, kv_usage: float | None) -> bool:
        """Whether a decode worker whose KV cache is ``kv_usage`` full (None: unknown) may compute a prompt the
        policy keeps local: always without a gate; with one, only when its fill is known and at most the gate."""
        return self.decode_busy is None or (kv_usage is not None and kv_usage <= self.decode_busy)

    def decide(self, prompt_tokens: int, uncached_tokens: int) -> str | None:
        """Why to compute a prompt of ``prompt_tokens`` on its decode worker, which lacks ``uncached_tokens``
        of it in its cache ("isl"), or None: on a prefill worker (with ``load``, one that is not busy)."""
        if self.mode is not DisaggMode.ISL:
            return None
        uncached = min(max(uncached_tokens, 0), prompt_tokens)
        if uncached < self.isl_threshold and uncached / max(prompt_tokens, 1) < self.isl_ratio:
            return "isl"
        return None


def prefill_busy(in_flight_tokens: int, capacity: int | None, share: float) -> bool:
    """Whether a prefill worker whose engine computes ``capacity`` prompt tokens a step (None: it does not say,
    and is never busy, as in Dynamo) is busy with ``in_flight_tokens`` sent to it and not yet computed."""
    return capacity is not None and in_flight_tokens > share * capacity
