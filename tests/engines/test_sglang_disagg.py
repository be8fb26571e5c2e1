"""SGLang in disaggregated serving, without SGLang: its Engine is a stand-in with the documented ``async_generate``
(engines/sglang/disagg.py says how SGLang pairs the two halves of a request: bootstrap host, port and room)."""

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engines.sglang.disagg import DEFAULT_BOOTSTRAP_PORT, SGLANG_HANDOFF
from engines.sglang.engine import SglangEngine
from engines.shared.gpu_engine_args import GpuPlacement
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError
from runtime.protocol import EngineOutput, KvHandoff, PreprocessedRequest, SamplingOptions, StopConditions
from tests.engines.test_sglang import FakeSglang, chunk


def request(min_tokens: int = 0, **fields: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r1", model="m", token_ids=[1, 2, 3], sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=8, min_tokens=min_tokens), **fields,
    )  # fmt: skip


def engine(role: str, fake: FakeSglang, **engine_args: Any) -> SglangEngine:
    built = SglangEngine(Path("/m"), GpuPlacement(), engine_args, role=role)  # type: ignore[arg-type]
    built._engine = fake
    return built


async def outputs(built: SglangEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [output async for output in built.generate(req, RequestContext(req.request_id))]


async def test_a_prefill_is_answered_with_its_bootstrap_room_at_once_while_sglang_runs_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SGLANG_HOST_IP", "10.0.0.7")
    consumed = asyncio.Event()

    class SlowPrefill(FakeSglang):
        async def async_generate(self, **kwargs: Any) -> Any:
            self.calls.append(kwargs)

            async def stream() -> Any:
                await asyncio.sleep(0.05)  # SGLang waits for the decode engine to connect to the room
                yield chunk([9], 1, {"type": "length", "length": 1})
                consumed.set()

            return stream()

    fake = SlowPrefill([])
    prefill = engine("prefill", fake)
    assert prefill.engine_args["disaggregation_mode"] == "prefill"
    [answer] = await outputs(prefill, request(min_tokens=2, prefill_only=True))
    assert not consumed.is_set()  # answered before SGLang's stream ended
    assert answer.token_ids == [] and answer.finish_reason == "length" and answer.handoff is not None
    params = answer.handoff.params
    assert (answer.handoff.kind, answer.handoff.prompt_tokens) == (SGLANG_HANDOFF, 3)
    assert (params["bootstrap_host"], params["bootstrap_port"]) == ("10.0.0.7", DEFAULT_BOOTSTRAP_PORT)
    assert 0 <= params["bootstrap_room"] < 2**63
    [call] = fake.calls
    assert {name: call[name] for name in params} == params
    assert (call["sampling_params"]["max_new_tokens"], call["sampling_params"]["min_new_tokens"]) == (1, 0)
    await asyncio.wait_for(consumed.wait(), 5)  # the stream was read to its end in the background
    await asyncio.sleep(0)
    assert not prefill._prefills  # and its task let go of


async def test_a_decode_request_names_the_prefill_engines_room_to_sglang() -> None:
    fake = FakeSglang([chunk([5], 1), chunk([5, 6], 2, {"type": "length", "length": 2})])
    decode = engine("decode", fake)
    assert decode.engine_args["disaggregation_mode"] == "decode"
    room = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 42}
    handoff = KvHandoff(kind=SGLANG_HANDOFF, prompt_tokens=3, params=room)
    answer = await outputs(decode, request(handoff=handoff))
    assert [output.token_ids for output in answer] == [[5], [6]]
    assert {name: fake.calls[0][name] for name in room} == room
    assert fake.calls[0]["sampling_params"]["max_new_tokens"] == 8


async def test_a_handoff_without_its_room_is_an_engine_error() -> None:
    decode = engine("decode", FakeSglang([]))
    handoff = KvHandoff(kind=SGLANG_HANDOFF, prompt_tokens=3, params={"bootstrap_host": "h", "bootstrap_port": 1})
    with pytest.raises(EngineError, match="without bootstrap_room"):
        await outputs(decode, request(handoff=handoff))


def test_a_disaggregation_mode_other_than_the_roles_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"disaggregation_mode 'decode'.*--disagg-role is prefill"):
        SglangEngine(Path("/m"), GpuPlacement(), {"disaggregation_mode": "decode"}, role="prefill")
    aggregated = SglangEngine(Path("/m"), GpuPlacement(), {})
    assert "disaggregation_mode" not in aggregated.engine_args and aggregated.bootstrap is None


def test_the_bootstrap_host_comes_from_dist_init_addr_without_sglang_host_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_HOST_IP", raising=False)
    built = SglangEngine(
        Path("/m"), GpuPlacement(), {"dist_init_addr": "10.1.2.3:5000", "disaggregation_bootstrap_port": 9000},
        role="prefill",
    )  # fmt: skip
    assert built.bootstrap == ("10.1.2.3", 9000)
    assert msgspec.json.encode(built.engine_args)  # plain values, as SGLang's ServerArgs takes them
