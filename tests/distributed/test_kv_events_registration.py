"""A worker's model registration says whether its engine publishes KV events, so that KV routers know to
predict the caches of those that do not (the mocker publishes them; echo_core, like llama.cpp, does not)."""

import json

from tests.distributed.cluster import Cluster, etcd_values
from tests.servers import smollm2_path


def test_the_registration_says_which_engines_publish_kv_events(cluster: Cluster) -> None:
    cluster.start_worker("dyn://silent", "out=echo_core", str(smollm2_path()), "--model-name", "silent")
    cluster.start_worker("dyn://talking", "out=mocker", str(smollm2_path()), "--model-name", "talking")
    entries = [json.loads(value) for value in etcd_values(cluster.etcd, "flotilla/models/").values()]
    assert {entry["card"]["name"]: entry["kv_events"] for entry in entries} == {"silent": False, "talking": True}
