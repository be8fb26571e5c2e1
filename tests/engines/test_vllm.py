"""out=vllm with vLLM's CPU build on SmolLM2 (safetensors, float32): greedy answers through `flotilla run in=http`
with the official openai client, the same text as the engine gives for the same token ids, cancellation
aborting the request in vLLM, the memory share reaching vLLM's config, bad engine arguments refused, and LoRA
adapters loaded and unloaded at run time (the in-process engine runs with LoRA enabled).

vLLM's CPU build is ~3.4 GB with its torch and Python 3.11-only, so it has a venv of its own: `make test-vllm`
(part of `make test`) builds that venv once (`make vllm`) and runs the tests marked vllm there; the main venv
skips them."""

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from typing import cast

import openai
import pytest
import pytest_asyncio

from runtime.engine import RequestContext
from runtime.errors import EngineError, RequestRejected
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEvent
from runtime.lora import lora_id
from runtime.protocol import EngineOutput, GuidedDecoding, PreprocessedRequest, SamplingOptions, StopConditions
from tests.engines.peft_adapter import write_peft_adapter
from tests.engines.vllm_model import ENGINE_ARGS, KV_CACHE_ENV, VLLM_MARKS
from tests.process_trees import Leftovers, descendants, running, wait_ended
from tests.servers import Server, launch_server, wait_until_live

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]

MODEL = "smol"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def launched_server(vllm_model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`flotilla run in=http out=vllm`, launched and not yet waited for: the in-process engine below starts
    while it loads (each start takes ~25 s here, much of it one core's work)."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    args = ["out=vllm", str(vllm_model_folder), "--model-name", MODEL, "--extra-engine-args", ENGINE_ARGS]
    launched = launch_server(args, log, env={**KV_CACHE_ENV, "FLOTILLA_GPU_MEMORY_UTILIZATION": "0.35"})
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def server(launched_server: Server, engine: object) -> Server:
    # ``engine`` first: it starts beside the server's process, not after it.
    return wait_until_live(launched_server, timeout=300)


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(launched_server: Server, vllm_model_folder: Path) -> AsyncIterator[object]:
    from engines.vllm.engine import VllmEngine
    from engines.vllm.settings import VllmSettings, read_extra_args

    os.environ.update(KV_CACHE_ENV)
    settings = VllmSettings(
        model=str(vllm_model_folder),
        max_model_len=2048,
        gpu_memory_utilization=0.35,
        extra=read_extra_args(ENGINE_ARGS),
        # LoRA enabled, for the adapter tests at the end: without an adapter its answers are still vLLM's own
        # server's (the comparisons above), and one engine start fewer keeps the vLLM step short.
        lora=True,
        max_loras=2,
    )
    started = VllmEngine(settings)
    await started.start()
    yield started
    await started.close()


def prompt_ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def request(token_ids: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"test-{os.urandom(4).hex()}",
        model=MODEL,
        token_ids=token_ids,
        sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


def test_a_requests_options_become_its_sampling_params() -> None:
    from vllm.sampling_params import RequestOutputKind

    from engines.vllm.engine import sampling_params

    given = request([1, 2, 3], 7)
    given.sampling = SamplingOptions(temperature=0.5, top_p=0.9, top_k=-1, seed=11, logit_bias={7: -100.0})
    given.stop_conditions = StopConditions(max_tokens=7, min_tokens=2)
    given.eos_token_ids = [2, 5]
    given.logprobs = 3
    given.prompt_logprobs = 1
    params = sampling_params(given)
    assert (params.max_tokens, params.min_tokens, params.temperature, params.top_p) == (7, 2, 0.5, 0.9)
    assert params.seed == 11 and params.logprobs == 3 and params.output_kind == RequestOutputKind.DELTA
    assert params.top_k in (0, -1) and set(params.stop_token_ids) == {2, 5} and not params.ignore_eos
    assert params.logit_bias == {7: -100.0} and params.prompt_logprobs == 1
    # ignore_eos ignores the chat template's end tokens too, as llama.cpp and the mocker do.
    ignoring = request([1, 2, 3], 7)
    ignoring.eos_token_ids = [2, 5]
    assert sampling_params(ignoring).stop_token_ids == []


def test_a_requests_constraint_becomes_its_structured_outputs() -> None:
    from engines.vllm.engine import sampling_params

    guided = request([1, 2, 3], 7)
    guided.guided = GuidedDecoding(choice=["yes", "no"])
    constraint = sampling_params(guided).structured_outputs
    assert constraint is not None and constraint.choice == ["yes", "no"]
    assert sampling_params(request([1, 2, 3], 7)).structured_outputs is None


def test_a_guided_choice_answer_is_one_of_the_choices(client: openai.OpenAI) -> None:
    if importlib.util.find_spec("xgrammar") is None:
        pytest.skip("this vLLM build has no xgrammar, its default structured-outputs backend: nothing to follow with")
    for question in ("Is Paris in France?", "Write a poem about the sea."):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=4,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert reply.choices[0].message.content in ("yes", "no"), question


def test_a_response_format_json_schema_answer_is_json_valid_against_it(client: openai.OpenAI) -> None:
    if importlib.util.find_spec("xgrammar") is None:
        pytest.skip("this vLLM build has no xgrammar, its default structured-outputs backend: nothing to follow with")
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is Paris in France? Answer in JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    answer = json.loads(reply.choices[0].message.content or "")
    assert set(answer) == {"answer"} and answer["answer"] in ("yes", "no")


def test_a_greedy_chat_answer_streams_through_flotilla_run(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital of France?"}
    ]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10)
    text = whole.choices[0].message.content or ""
    assert "Paris" in text and whole.usage is not None and whole.usage.completion_tokens <= 10
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_log_probabilities_come_from_vllm_one_per_token(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == 4 and all(
        value is not None and value <= 0 for value in logprobs.token_logprobs
    )
    # Greedy: each chosen token is the likeliest of its two alternatives.
    assert all(
        len(top) == 2 and max(top.values()) == chosen
        for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True)
    )


@pytest.mark.asyncio(loop_scope="module")
async def test_echoed_prompt_logprobs_are_vllms_own_prompt_logprobs(
    client: openai.OpenAI, engine: object, vllm_model_folder: Path
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    ids = prompt_ids(vllm_model_folder, PROMPT + " Paris.")
    served = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0)
    logprobs = served.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    own = None
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    async for output in engine._engine.generate(TokensPrompt(prompt_token_ids=ids), params, "own-prompt-logprobs"):
        own = output.prompt_logprobs
    assert own is not None and own[0] is None and logprobs.token_logprobs[0] is None
    expected = [own[i][ids[i]].logprob for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    assert served.choices[0].text.startswith(PROMPT) and served.choices[0].finish_reason == "length"
    assert served.usage is not None and (served.usage.prompt_tokens, served.usage.completion_tokens) == (len(ids), 1)


TINY_TASK = """\
task: flotilla_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.asyncio(loop_scope="module")
async def test_lm_evaluation_harness_loglikelihoods_through_flotilla_are_vllms_own(
    server: Server, engine: object, vllm_model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-evaluation-harness itself (``local-completions``, the model evaluation harnesses point at an OpenAI
    server) runs a small multiple-choice task through Flotilla; each answer's log-likelihood is the sum that
    vLLM's own ``prompt_logprobs`` give for the same tokens."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    questions = [
        {"question": "The capital of France is", "choices": [" Paris", " London", " Rome"], "answer": 0},
        {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    ]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(question) + "\n" for question in questions))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TINY_TASK.format(data=data))
    arguments = f"model={MODEL},base_url={server.api_url}/completions,tokenizer_backend=huggingface,"
    arguments += f"tokenizer={vllm_model_folder},tokenized_requests=True,num_concurrent=1,max_retries=1"
    harness = get_model("local-completions").create_from_arg_string(arguments)
    tasks = TaskManager(include_path=str(tmp_path / "tasks"))
    results = await asyncio.to_thread(
        simple_evaluate, model=harness, tasks=["flotilla_tiny"], task_manager=tasks, log_samples=True
    )

    samples = results["samples"]["flotilla_tiny"]
    assert sum(len(sample["arguments"]) for sample in samples) == 5
    for sample in samples:
        for (context, continuation), [(likelihood, _)] in zip(sample["arguments"], sample["resps"], strict=True):
            context_ids, continuation_ids = harness._encode_pair(context, continuation)
            ids = list(context_ids) + list(continuation_ids)
            own = None
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
            async for output in engine._engine.generate(
                TokensPrompt(prompt_token_ids=ids), params, os.urandom(4).hex()
            ):
                own = output.prompt_logprobs
            assert own is not None
            expected = sum(own[i][ids[i]].logprob for i in range(len(context_ids), len(ids)))
            assert likelihood == pytest.approx(expected, abs=1e-3), (context, continuation)
    assert "acc,none" in results["results"]["flotilla_tiny"]


@pytest.mark.asyncio(loop_scope="module")
async def test_the_served_text_is_the_engines_for_the_same_token_ids(
    client: openai.OpenAI, engine: object, vllm_model_folder: Path
) -> None:
    from tokenizers import Tokenizer

    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    ids = prompt_ids(vllm_model_folder, PROMPT)
    served = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, stream=True)
    served_text = "".join(chunk.choices[0].text for chunk in served if chunk.choices)
    generated: list[int] = []
    finish = None
    async for output in engine.generate(request(ids, 8), RequestContext("same-ids")):
        generated += output.token_ids
        finish = output.finish_reason or finish
    assert len(generated) == 8 and finish == "length"
    tokenizer = Tokenizer.from_file(str(vllm_model_folder / "tokenizer.json"))
    assert served_text == tokenizer.decode(generated) and "Paris" in served_text


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stream_closed_early_is_aborted_in_vllm(engine: object, vllm_model_folder: Path) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    core = engine._engine
    generated = engine.generate(request(prompt_ids(vllm_model_folder, PROMPT), 1500), RequestContext("cut"))
    stream = cast(AsyncGenerator[EngineOutput], generated)
    got = [await anext(stream) for _ in range(3)]
    assert all(output.token_ids for output in got) and got[0].cached_tokens is not None
    assert core.output_processor.get_num_unfinished_requests() == 1
    # What the gateway does when the client goes away or a stop string matches.
    await stream.aclose()
    assert core.output_processor.get_num_unfinished_requests() == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_the_routers_dp_rank_reaches_vllm(engine: object, vllm_model_folder: Path) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    ranked = request(prompt_ids(vllm_model_folder, "Hello"), 2)
    ranked.dp_rank = 0
    assert [output async for output in engine.generate(ranked, RequestContext("rank-0"))]
    # vLLM checks the rank against its data-parallel size (vllm/v1/engine/input_processor.py): it was given it.
    ranked.dp_rank = 3
    with pytest.raises(RequestRejected, match="data_parallel_rank 3"):
        [output async for output in engine.generate(ranked, RequestContext("rank-3"))]
    assert [load.dp_rank for load in engine.load()] == [0]


@pytest.mark.asyncio(loop_scope="module")
async def test_vllms_own_prometheus_metrics_are_there_for_the_workers_metrics_port(engine: object) -> None:
    from prometheus_client.exposition import generate_latest

    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    exposition = generate_latest(engine.prometheus_registry()).decode()
    # vLLM's own names, as its OpenAI server's /metrics shows them (the worker serves them after its own).
    assert "vllm:num_requests_running" in exposition and "vllm:kv_cache_usage_perc" in exposition


@pytest.mark.asyncio(loop_scope="module")
async def test_the_memory_share_and_context_length_reach_vllms_config(engine: object) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    config = engine._engine.vllm_config
    assert config.cache_config.gpu_memory_utilization == 0.35
    assert config.model_config.max_model_len == 2048 and config.cache_config.block_size == 32
    # Registered with the model, for --disagg-policy load: vLLM's step budget.
    assert engine.prefill_token_capacity == config.scheduler_config.max_num_batched_tokens > 0


@pytest.mark.asyncio(loop_scope="module")
async def test_a_repeated_prompt_is_served_from_vllms_prefix_cache(engine: object, vllm_model_folder: Path) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    ids = prompt_ids(vllm_model_folder, "word " * 80)
    cached: list[int | None] = []
    for _ in range(2):
        outputs = [output async for output in engine.generate(request(ids, 2), RequestContext("again"))]
        cached.append(outputs[0].cached_tokens)
    # The second time, every whole 32-token block of the first prompt is found in vLLM's cache.
    assert cached[0] == 0 and cached[1] == len(ids) // 32 * 32
    load = engine.load()[0]
    assert load.prefix_hit_rate is not None and load.prefix_hit_rate > 0


def test_an_unknown_engine_argument_is_refused_naming_it(vllm_model_folder: Path) -> None:
    code = "import sys\nfrom launcher.cli import main\nsys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "run",
            "out=vllm",
            str(vllm_model_folder),
            "--extra-engine-args",
            '{"blok_size": 32}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "unknown key 'blok_size'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.asyncio(loop_scope="module")
async def test_vllms_kv_events_name_its_blocks_as_a_router_does(engine: object, vllm_model_folder: Path) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    heard: list[KvEvent] = []
    arrived = asyncio.Event()

    class Sink:
        def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
            assert dp_rank == 0
            heard.extend(events)
            arrived.set()

    engine.attach_kv_events(Sink())
    ids = prompt_ids(vllm_model_folder, "The quick brown fox jumps over the lazy dog. " * 12)  # several full blocks
    async for _ in engine.generate(request(ids, 1), RequestContext("kv-events")):
        pass
    # The router names a prompt's blocks with Flotilla's chained hash: vLLM's events, renamed, must match.
    expected = sequence_block_hashes(ids, engine.block_size)
    assert len(expected) >= 3

    def stored() -> set[int]:
        return {name for event in heard if isinstance(event, BlockStored) for name in event.block_hashes}

    async with asyncio.timeout(30):  # vLLM publishes from its engine core process, over ZMQ
        while not set(expected) <= stored():
            arrived.clear()
            await arrived.wait()
    state = {name for event in engine.cache_state(None)[0] for name in event.block_hashes}
    assert set(expected) <= state  # what a router asking for the whole cache is told


# Last in the module, on purpose: it kills the module's server (its fixture's stop then has nothing to do).
def test_flotilla_run_out_vllm_killed_with_sigkill_leaves_no_engine_core(server: Server) -> None:
    # As the out-of-memory killer kills: vLLM's engine core (on a GPU node, the GPU memory a replacement needs)
    # must end with it. launcher/worker_tree.py's guard ends it here; under the agent, the agent does.
    engine = descendants(server.process.pid)
    leftovers = Leftovers()
    leftovers.add(engine)
    try:
        titles = [command_line(pid) for pid in engine]
        assert any("EngineCore" in title for title in titles), titles  # vLLM's own title for it
        server.process.kill()
        assert server.process.wait(timeout=30) == -9
        assert wait_ended(engine, timeout_s=60) == [], [command_line(pid) for pid in running(engine)]
    finally:
        leftovers.kill()


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# LoRA adapters (vLLM's CPU build runs them: its PunicaWrapperCPU), on this module's engine, started with LoRA
# enabled: an adapter loaded at run time changes the greedy answer, its KV events carry its lora id, and once
# unloaded it is refused. The adapter is a tiny random PEFT one (tests/engines/peft_adapter.py).


def lora_request(token_ids: list[int], lora_name: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"lora-{os.urandom(4).hex()}",
        model=MODEL,
        token_ids=token_ids,
        sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=8, ignore_eos=True),
        lora_name=lora_name,
    )


async def lora_answer(engine: object, req: PreprocessedRequest) -> list[int]:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    return [token async for out in engine.generate(req, RequestContext(req.request_id)) for token in out.token_ids]


@pytest.mark.asyncio(loop_scope="module")
async def test_an_adapter_loaded_at_run_time_changes_the_answer_tags_its_blocks_and_is_refused_once_unloaded(
    engine: object, vllm_model_folder: Path, tmp_path: Path
) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    assert engine.max_loras == 2  # vLLM's settled config
    heard: list[KvEvent] = []
    arrived = asyncio.Event()

    class Sink:
        def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
            heard.extend(events)
            arrived.set()

    engine.attach_kv_events(Sink())
    ids = prompt_ids(vllm_model_folder, "The quick brown fox jumps over the lazy dog. " * 8)  # full KV blocks
    base = await lora_answer(engine, lora_request(ids))

    folder = write_peft_adapter(vllm_model_folder, tmp_path / "tiny")
    await engine.load_lora("tiny", folder)
    await engine.load_lora("tiny", folder)  # the same again: nothing to do
    adapted = await lora_answer(engine, lora_request(ids, "tiny"))
    assert len(adapted) == len(base) == 8
    assert adapted != base
    assert await lora_answer(engine, lora_request(ids)) == base  # the base model is untouched beside it

    async with asyncio.timeout(30):  # vLLM publishes from its engine core process, over ZMQ
        while not any(isinstance(event, BlockStored) and event.lora_id == lora_id("tiny") for event in heard):
            arrived.clear()
            await arrived.wait()

    await engine.unload_lora("tiny")
    with pytest.raises(EngineError, match="'tiny' is not loaded"):
        await lora_answer(engine, lora_request(ids, "tiny"))
    await engine.load_lora("tiny", folder)  # and back, without a restart
    assert await lora_answer(engine, lora_request(ids, "tiny")) == adapted


@pytest.mark.asyncio(loop_scope="module")
async def test_an_adapter_vllm_cannot_load_is_an_engine_error_naming_it(engine: object, tmp_path: Path) -> None:
    from engines.vllm.engine import VllmEngine

    assert isinstance(engine, VllmEngine)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    with pytest.raises(EngineError, match="'broken'"):
        await engine.load_lora("broken", broken)
    assert "broken" not in engine.adapters.book  # type: ignore[union-attr]
