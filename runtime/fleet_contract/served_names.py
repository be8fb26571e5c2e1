"""The model names the control plane's pipelines serve, as it tells the ingress processes.

An ingress knows a model only while instances of it are registered; without this, a model whose pipeline
is stopped, or whose first replica is still loading, would be a 404 "does not exist". The control plane
puts one record per pipeline under ``flotilla/served-names/<served name>`` (its state), so an ingress can
answer 503 "no ready replica" (retry later) instead. Unsigned: a forged record can only turn a 404 into a
503 for a name that serves nothing.
"""

import msgspec

SERVED_NAMES_PREFIX = "flotilla/served-names/"


class ServedName(msgspec.Struct, frozen=True, kw_only=True):
    #: The pipeline's desired state: "running" (replicas may be on their way) or "stopped".
    state: str


def etcd_key(name: str) -> str:
    return SERVED_NAMES_PREFIX + name
