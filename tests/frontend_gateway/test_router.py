"""The routing decision: a pure function of the request, the candidates and the router's state."""

from frontend_gateway.router import InstanceInfo, Router, RouterMode
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions

REQUEST = PreprocessedRequest(
    request_id="r", model="m", token_ids=[1], sampling=SamplingOptions(), stop_conditions=StopConditions(max_tokens=1)
)
INSTANCES = [InstanceInfo(1, "s.1"), InstanceInfo(2, "s.2"), InstanceInfo(3, "s.3")]


def test_round_robin_takes_each_instance_in_turn() -> None:
    router = Router(RouterMode.ROUND_ROBIN)
    chosen = [router.choose(REQUEST, INSTANCES) for _ in range(6)]
    assert [info.instance_id for info in chosen if info] == [2, 3, 1, 2, 3, 1]


def test_random_with_a_seed_is_repeatable_and_covers_every_instance() -> None:
    first = [Router(RouterMode.RANDOM, seed=5).choose(REQUEST, INSTANCES) for _ in range(3)]
    assert len(set(first)) == 1
    router = Router(RouterMode.RANDOM, seed=5)
    assert {router.choose(REQUEST, INSTANCES) for _ in range(60)} == set(INSTANCES)


def test_no_candidates_means_no_choice() -> None:
    assert Router(RouterMode.ROUND_ROBIN).choose(REQUEST, []) is None
    assert Router(RouterMode.RANDOM).choose(REQUEST, []) is None


def test_instance_names_are_their_hex_ids() -> None:
    assert InstanceInfo(255, "s").name == "ff"
