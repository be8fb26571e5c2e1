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


class PipelineRouter(msgspec.Struct, frozen=True, kw_only=True):
    """A pipeline's router settings. Its workers register them in etcd (``ModelEntry.router``), and the
    gateway routes their model with them, so one gateway serves pipelines routed differently."""

    mode: str = "round-robin"  # "random", "round-robin" or "kv"
    overlap_score_weight: float = 1.0
    queued_prefill_weight: float = DEFAULT_QUEUED_PREFILL_WEIGHT
    temperature: float = 0.0
    use_kv_events: bool = True
    #: Counts the pipeline's changes of these settings: a gateway routes a pool with the newest it has seen.
    generation: int = 0
