"""Building a pool's router from the settings: one implementation per mode, bad settings refused."""

from typing import cast

import pytest
from nats.aio.client import Client as NATS

from frontend_gateway.routing.basic import RandomRouter, RoundRobinRouter
from frontend_gateway.routing.factory import build_router
from frontend_gateway.routing.kv_indexer import KvIndexer, PredictedKvIndexer
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.protocol import RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress

NC = cast(NATS, None)  # building starts nothing: no connection is used
ADDRESS = EndpointAddress("llm")


def test_each_mode_builds_its_router() -> None:
    def build(**settings: object) -> object:
        return build_router(RouterSettings(**settings), block_size=16, nc=NC, address=ADDRESS)  # type: ignore[arg-type]

    assert isinstance(build(mode=RouterMode.RANDOM), RandomRouter)
    assert isinstance(build(mode=RouterMode.ROUND_ROBIN), RoundRobinRouter)
    kv = build(mode=RouterMode.KV)
    assert isinstance(kv, KvRouter) and isinstance(kv.indexer, KvIndexer)
    predicted = build(mode=RouterMode.KV, use_kv_events=False, predicted_ttl_s=30.0, predicted_max_blocks=99)
    assert isinstance(predicted, KvRouter) and isinstance(predicted.indexer, PredictedKvIndexer)
    assert (predicted.indexer.ttl_s, predicted.indexer.max_blocks) == (30.0, 99)


def test_the_kv_router_needs_a_block_size_and_an_endpoint() -> None:
    settings = RouterSettings(mode=RouterMode.KV)
    with pytest.raises(ValueError, match="block size must be at least 1, not 0"):
        build_router(settings, block_size=0, nc=NC, address=ADDRESS)
    with pytest.raises(ValueError, match="needs the endpoint"):
        build_router(settings, block_size=16, nc=NC, address=None)
    # The basic routers need neither.
    assert isinstance(build_router(RouterSettings(), block_size=0, nc=NC, address=None), RoundRobinRouter)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("overlap_score_weight", -0.5),
        ("overlap_score_weight", float("nan")),
        ("queued_prefill_weight", -0.1),
        ("queued_prefill_weight", 1.5),
        ("queued_prefill_weight", float("nan")),
        ("temperature", -1.0),
        ("predicted_ttl_s", 0.0),
        ("predicted_max_blocks", 0),
    ],
)
def test_settings_out_of_range_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RouterSettings(**{field: value})  # type: ignore[arg-type]
