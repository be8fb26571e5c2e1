"""A pipeline's router settings and the routing defaults that the gateway's own settings share.

The control plane sends them to a pipeline's workers (``WorkerSpec.router``, as ``--router-*`` flags), the
workers register them in etcd with their model (``ModelEntry.router``), and each gateway routes the model
with them; a gateway started with its own ``--router-*`` flags takes the same defaults from here.
"""

import msgspec

#: Share of the prompt tokens already in flight to a worker that a new request is taken to wait for: by
#: the time the router counts them, the step in progress has computed part of them and some are done with
#: their notice on its way; and unlike the request's own prefill they delay only it, not every request
#: queued behind it. 0.5 measured best with weight 8 (bench/routing_sim.py, docs/benchmarks.md). Here, not
#: in the gateway, so that a pipeline's settings and a gateway's own share the one default.
DEFAULT_QUEUED_PREFILL_WEIGHT = 0.5
#: Where a model with prefill workers has its prompts computed (frontend_gateway/routing/disagg_policy.py):
#: always on a prefill worker, by what is left to compute (isl), or while the prefill workers are not busy (load).
DISAGG_POLICIES = ("always", "isl", "load")
#: Dynamo's defaults for its ``isl_bounding`` policy (tokens left to compute, and their share of the prompt).
DEFAULT_ISL_THRESHOLD = 2048
DEFAULT_ISL_RATIO = 0.7
#: ``load``: a prefill worker with more prompt tokens in flight than this many engine steps is busy (Dynamo's
#: ``prefill_busy_threshold`` has no default of its own; one step).
DEFAULT_PREFILL_BUSY = 1.0
#: How much a prompt block found on a tier below the device saves, against one found on the device (1.0):
#: bringing it back costs a copy, not a prefill. Dynamo's defaults (``--router-host-cache-hit-weight``,
#: ``--router-disk-cache-hit-weight``); the disk weight also applies to a store outside the node.
DEFAULT_HOST_HIT_WEIGHT = 0.75
DEFAULT_DISK_HIT_WEIGHT = 0.25


class PipelineRouter(msgspec.Struct, frozen=True, kw_only=True):
    """A pipeline's router settings. Its workers register them in etcd (``ModelEntry.router``), and the
    gateway routes their model with them, so one gateway serves pipelines routed differently."""

    mode: str = "round-robin"  # "random", "round-robin" or "kv"
    overlap_score_weight: float = 1.0
    queued_prefill_weight: float = DEFAULT_QUEUED_PREFILL_WEIGHT
    temperature: float = 0.0
    use_kv_events: bool = True
    #: Credit of a prompt block cached in host memory, and on a disk or outside the node, against a device hit.
    host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT
    disk_hit_weight: float = DEFAULT_DISK_HIT_WEIGHT
    #: Where the model's prompts are computed when it has prefill workers, and the policies' thresholds.
    disagg_policy: str = "always"
    disagg_isl_threshold: int = DEFAULT_ISL_THRESHOLD
    disagg_isl_ratio: float = DEFAULT_ISL_RATIO
    disagg_prefill_busy: float = DEFAULT_PREFILL_BUSY
    disagg_decode_busy: float | None = None  # the decode gate: None, none
    #: Counts the pipeline's changes of these settings: a gateway routes a pool with the newest it has seen.
    generation: int = 0
