"""Random and round-robin routers: pure decisions over the candidates, as before the router seam."""

from frontend_gateway.routing.basic import RandomRouter, RoundRobinRouter
from frontend_gateway.routing.protocol import Decision, InstanceInfo
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions

REQUEST = PreprocessedRequest(
    request_id="r",
    model="m",
    token_ids=[1, 2, 3],
    sampling=SamplingOptions(),
    stop_conditions=StopConditions(max_tokens=1),
)
INSTANCES = [InstanceInfo(1, "s.1"), InstanceInfo(2, "s.2"), InstanceInfo(3, "s.3")]


def chosen_id(decision: Decision | None) -> int:
    assert decision is not None
    return decision.instance.instance_id


def test_round_robin_takes_each_instance_in_turn() -> None:
    router = RoundRobinRouter()
    assert [chosen_id(router.choose(REQUEST, INSTANCES)) for _ in range(6)] == [2, 3, 1, 2, 3, 1]


def test_random_with_a_seed_is_repeatable_and_covers_every_instance() -> None:
    first = [chosen_id(RandomRouter(seed=5).choose(REQUEST, INSTANCES)) for _ in range(3)]
    assert len(set(first)) == 1
    router = RandomRouter(seed=5)
    assert {chosen_id(router.choose(REQUEST, INSTANCES)) for _ in range(60)} == {1, 2, 3}


def test_no_candidates_means_no_choice() -> None:
    assert RoundRobinRouter().choose(REQUEST, []) is None
    assert RandomRouter().choose(REQUEST, []) is None


def test_a_basic_decision_expects_no_cache_hit_and_leaves_the_rank_to_the_engine() -> None:
    decision = RoundRobinRouter().choose(REQUEST, INSTANCES)
    assert decision == Decision(INSTANCES[1], dp_rank=None, overlap_blocks=0, prefill_tokens=3)


async def test_the_notices_are_accepted_and_change_nothing() -> None:
    router = RoundRobinRouter()
    await router.start()
    router.instance_added(INSTANCES[0])
    router.prefill_done("unknown")
    router.finished("unknown")
    router.instance_removed(1)
    await router.close()
    assert [chosen_id(router.choose(REQUEST, INSTANCES)) for _ in range(3)] == [2, 3, 1]


def test_instance_names_are_their_hex_ids() -> None:
    assert InstanceInfo(255, "s").name == "ff"
