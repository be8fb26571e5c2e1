"""The remote engines tell the router of each decision's first output and of its end, exactly once.

The request plane is replaced by a scripted client here: what is under test is the engine's
bookkeeping around each attempt, whatever way the attempt ends.
"""

from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import pytest

from frontend_gateway.models.remote_engines import InstanceSet, RemoteTextEngine, RemoteTokenEngine
from frontend_gateway.routing.protocol import Decision, InstanceInfo
from runtime.engine import RequestContext
from runtime.errors import EngineBusy, EngineError, EngineStalled, EngineUnavailable
from runtime.protocol import (
    EngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    TextOutput,
    TextRequest,
)
from runtime.request_plane import RemoteError, StreamBroken, StreamStalled, WorkerBusy, WorkerUnavailable

A, B = InstanceInfo(1, "s.1"), InstanceInfo(2, "s.2")


class ListRouter:
    """Chooses the first candidate and writes down every notice."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.busy_ids: set[int] = set()

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision | None:
        if not candidates:
            return None
        self.log.append(f"choose {candidates[0].instance_id}")
        return Decision(candidates[0])

    def prefill_done(self, request_id: str) -> None:
        self.log.append("prefill_done")

    def finished(self, request_id: str) -> None:
        self.log.append("finished")

    def kv_usage(self, instance_id: int, dp_rank: int | None) -> float | None:
        return None

    def busy(self, instance_id: int) -> bool:
        return instance_id in self.busy_ids

    def instance_added(self, instance: InstanceInfo) -> None: ...

    def instance_removed(self, instance_id: int) -> None: ...


class ScriptedClient:
    """Answers each subject with its script: frames of outputs, then optionally an exception."""

    connected = True

    def __init__(self, scripts: dict[str, tuple[list[Any], Exception | None]]) -> None:
        self.scripts = scripts
        self.gone: set[str] = set()

    def avoided(self, subject: str) -> bool:
        return subject in self.gone

    async def call(self, subject: str, request_id: str, payload: bytes) -> AsyncIterator[list[bytes]]:
        outputs, error = self.scripts[subject]
        for output in outputs:
            yield [msgspec.msgpack.encode(output)]
        if error is not None:
            raise error


class Runtime:
    def __init__(self, client: ScriptedClient) -> None:
        self._client = client

    async def client(self) -> ScriptedClient:
        return self._client


def instances(*infos: InstanceInfo) -> InstanceSet:
    pool = InstanceSet()
    for info in infos:
        pool.add(info)
    return pool


def token_engine(router: ListRouter, scripts: dict[str, Any], migration_limit: int = 0) -> RemoteTokenEngine:
    return RemoteTokenEngine("m", instances(A, B), router, Runtime(ScriptedClient(scripts)), migration_limit)  # type: ignore[arg-type]


REQUEST = PreprocessedRequest(
    request_id="r",
    model="m",
    token_ids=[1, 2, 3],
    sampling=SamplingOptions(),
    stop_conditions=StopConditions(max_tokens=4),
)


async def drain(engine: RemoteTokenEngine) -> list[EngineOutput]:
    return [output async for output in engine.generate(REQUEST, RequestContext("r"))]


async def test_a_stream_that_ends_well_gives_one_prefill_done_and_one_finished() -> None:
    router = ListRouter()
    outputs = [EngineOutput([5]), EngineOutput([6]), EngineOutput([7], finish_reason="length")]
    assert len(await drain(token_engine(router, {A.subject: (outputs, None)}))) == 3
    assert router.log == ["choose 1", "prefill_done", "finished"]


async def test_a_worker_that_fails_before_its_first_output_is_finished_without_prefill_done() -> None:
    router = ListRouter()
    with pytest.raises(EngineError):
        await drain(token_engine(router, {A.subject: ([], RemoteError("boom"))}))
    assert router.log == ["choose 1", "finished"]


async def test_a_worker_that_did_not_take_the_request_is_finished_before_the_next_choice() -> None:
    router = ListRouter()
    scripts = {A.subject: ([], WorkerUnavailable("gone")), B.subject: ([EngineOutput([5], finish_reason="stop")], None)}
    await drain(token_engine(router, scripts))
    assert router.log == ["choose 1", "finished", "choose 2", "prefill_done", "finished"]


async def test_a_migrated_request_finishes_each_attempt_once() -> None:
    router = ListRouter()
    scripts = {
        A.subject: ([EngineOutput([5])], StreamBroken("worker died")),
        B.subject: ([EngineOutput([6], finish_reason="length")], None),
    }
    assert len(await drain(token_engine(router, scripts, migration_limit=1))) == 2
    assert router.log == ["choose 1", "prefill_done", "finished", "choose 2", "prefill_done", "finished"]


async def test_a_client_that_goes_away_mid_stream_still_finishes_the_decision() -> None:
    router = ListRouter()
    engine = token_engine(router, {A.subject: ([EngineOutput([5]), EngineOutput([6])], None)})
    stream = engine.generate(REQUEST, RequestContext("r"))
    await anext(stream)
    await stream.aclose()  # what the pipeline does when the client disconnects
    assert router.log == ["choose 1", "prefill_done", "finished"]


async def test_no_instance_means_no_decision_and_no_notice() -> None:
    router = ListRouter()
    engine = RemoteTokenEngine("m", InstanceSet(), router, Runtime(ScriptedClient({})), 0)  # type: ignore[arg-type]
    with pytest.raises(EngineUnavailable):
        await drain(engine)
    assert router.log == []


async def test_a_text_stream_gives_the_same_notices() -> None:
    router = ListRouter()
    runtime = Runtime(ScriptedClient({A.subject: ([TextOutput(text="hi", completion_tokens=1)], StreamBroken("x"))}))
    engine = RemoteTextEngine("m", instances(A), router, runtime, 0)  # type: ignore[arg-type]
    stop = StopConditions(max_tokens=4)
    request = TextRequest(request_id="t", model="m", prompt="hello", sampling=SamplingOptions(), stop_conditions=stop)
    with pytest.raises(EngineError):
        async for _ in engine.generate(request, RequestContext("t")):
            pass
    assert router.log == ["choose 1", "prefill_done", "finished"]


async def test_the_chosen_dp_rank_travels_with_the_request() -> None:
    class RankRouter(ListRouter):
        def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision:
            return Decision(candidates[0], dp_rank=3)

    sent: list[PreprocessedRequest] = []

    class RecordingClient(ScriptedClient):
        async def call(self, subject: str, request_id: str, payload: bytes) -> AsyncIterator[list[bytes]]:
            sent.append(msgspec.msgpack.decode(payload, type=PreprocessedRequest))
            async for frame in super().call(subject, request_id, payload):
                yield frame

    client = RecordingClient({A.subject: ([EngineOutput([5], finish_reason="stop")], None)})
    engine = RemoteTokenEngine("m", instances(A), RankRouter(), Runtime(client), 0)  # type: ignore[arg-type]
    await drain(engine)
    assert [request.dp_rank for request in sent] == [3]


async def test_an_instance_that_refuses_as_busy_sends_the_request_to_the_next() -> None:
    router = ListRouter()
    scripts = {A.subject: ([], WorkerBusy("queue full")), B.subject: ([EngineOutput([5], finish_reason="stop")], None)}
    await drain(token_engine(router, scripts))
    assert router.log == ["choose 1", "finished", "choose 2", "prefill_done", "finished"]


async def test_when_every_instance_refuses_as_busy_the_request_is_refused_as_busy() -> None:
    router = ListRouter()
    scripts: dict[str, Any] = {A.subject: ([], WorkerBusy("queue full")), B.subject: ([], WorkerBusy("queue full"))}
    with pytest.raises(EngineBusy):
        await drain(token_engine(router, scripts))


async def test_an_instance_past_its_busy_threshold_gets_no_new_request() -> None:
    router = ListRouter()
    router.busy_ids = {1}
    await drain(token_engine(router, {B.subject: ([EngineOutput([5], finish_reason="stop")], None)}))
    assert router.log[0] == "choose 2"


async def test_when_every_instance_is_past_its_busy_threshold_nothing_is_chosen() -> None:
    router = ListRouter()
    router.busy_ids = {1, 2}
    with pytest.raises(EngineBusy):
        await drain(token_engine(router, {}))
    assert router.log == []


async def test_a_migrating_request_goes_on_even_to_a_busy_instance() -> None:
    router = ListRouter()
    router.busy_ids = {2}
    scripts = {
        A.subject: ([EngineOutput([5])], StreamBroken("worker died")),
        B.subject: ([EngineOutput([6], finish_reason="length")], None),
    }
    assert len(await drain(token_engine(router, scripts, migration_limit=1))) == 2


async def test_an_avoided_instance_gets_no_request_while_another_is_left() -> None:
    router = ListRouter()
    client = ScriptedClient({B.subject: ([EngineOutput([5], finish_reason="stop")], None)})
    client.gone = {A.subject}
    await drain(RemoteTokenEngine("m", instances(A, B), router, Runtime(client), 0))  # type: ignore[arg-type]
    assert router.log[0] == "choose 2"
    client = ScriptedClient({A.subject: ([EngineOutput([5], finish_reason="stop")], None)})
    client.gone = {A.subject}
    router = ListRouter()
    await drain(RemoteTokenEngine("m", instances(A), router, Runtime(client), 0))  # type: ignore[arg-type]
    assert router.log[0] == "choose 1"


async def test_a_stalled_stream_is_migrated_or_else_fails_as_stalled() -> None:
    scripts = {
        A.subject: ([EngineOutput([5])], StreamStalled("no output for 2 s")),
        B.subject: ([EngineOutput([6], finish_reason="length")], None),
    }
    assert len(await drain(token_engine(ListRouter(), scripts, migration_limit=1))) == 2
    with pytest.raises(EngineStalled):
        await drain(token_engine(ListRouter(), scripts, migration_limit=0))
