#!/usr/bin/env bash
# Smoke test of out=vllm, out=sglang and out=trtllm on a GPU machine: what the CPU-only test suite cannot run.
#
# Usage:  bench/gpu_engines_check.sh MODEL_DIR [ENGINE ...]
#   MODEL_DIR  a Hugging Face folder with safetensors (config.json, tokenizer.json, *.safetensors), e.g.
#              SmolLM2-135M-Instruct or Qwen2.5-0.5B-Instruct, already on the machine (it may have no network)
#   ENGINE     vllm, sglang and/or trtllm (default: all three); an engine whose package is missing is reported SKIP
#   EXTRA_ENGINE_ARGS (environment) the engine's --extra-engine-args for every start, e.g. '{"enforce_eager": true}'
# Needs: one CUDA GPU, this repo's venv (.venv, or VENV=...) with `pip install -e '.[vllm]'`, `'.[sglang]'` and/or
# `pip install --extra-index-url https://pypi.nvidia.com -e '.[trtllm]'` (one library per venv is safest:
# they pin different torch builds). GPU memory: each engine is started with --gpu-memory-utilization
# $SHARE (default 0.4), one at a time.
#
# What it checks, per engine, printing one "PASS|FAIL|SKIP engine check: detail" line each, exit 1 on a FAIL:
#   1. in the worker process (launcher.run.build_model, as `flotilla run` builds it): the engine starts with
#      the placement's memory share; a greedy request completes with a finish reason; the same request again
#      gives the same tokens (token-exact at temperature 0) and reports cached prompt tokens (prefix reuse);
#      a request abandoned after 2 tokens is aborted (the engine serves the next one); the engine's KV events
#      arrive as Flotilla BlockStored events named with runtime/kv/blocks.py's hashes, and cache_state()
#      holds the blocks;
#   2. through the CLI: `flotilla run in=http out=ENGINE MODEL_DIR` answers a chat completion over HTTP, and
#      an unknown --extra-engine-args key exits 2 naming it;
#   3. KV offloading to host memory (vllm: {"kv_offloading_size": 1}, vLLM's OffloadingConnector, which its CPU
#      build refuses; sglang: {"enable_hierarchical_cache": true, "hicache_write_policy": "write_through"}), the
#      engine restarted with those arguments added: the prompt's blocks are stored on the host tier (events with
#      medium "cpu", named as the router names them), the load report has a "cpu" tier holding them, and
#      cache_state() lists them with their medium. TensorRT-LLM moves a block to its host pool only when the GPU
#      pool evicts it, which a short check on a large GPU does not reach: it is not checked here (OFFLOAD=0
#      skips this part for every engine).
#   4. sglang only, in the worker process: what the fakes of tests/engines/test_sglang*.py cannot show of SGLang
#      itself: min_tokens is refused with a 400 naming it and the engine serves on; a request cancelled before
#      its first token (a long prompt, still prefilling) is let go of by SGLang (its rid_to_state empties); a
#      SIGTERM after SGLang served requests reaches the worker's handler, not SGLang's; an answer constrained
#      by a JSON schema parses and has the schema's fields; log probabilities come with each token; the KV
#      block size is the page size SGLang settled on.
#   5. LoRA adapters (issue 38), per engine, in the worker process: the engine started as `flotilla run --lora-file`
#      starts it (LoRA enabled); a tiny random PEFT adapter for MODEL_DIR (tests/engines/peft_adapter.py) is loaded
#      while base-model requests run (none of them fails); a greedy answer with it differs from the base model's
#      and the base model's is unchanged; vLLM's KV events of its blocks carry lora_id(name) and are named from the
#      adapter's root (runtime/lora.py); unloaded while an adapter request runs, that request ends (an error or its
#      end) and a new one is refused; loaded again, it answers as before (LORA=0 skips this part).
# Not checked here (one machine): SGLang's attention DP across nodes (engines/sglang/dp_relay.py). A two-node run
# would start the leader (`flotilla run in=dyn://NS.backend.generate out=sglang MODEL_DIR --num-nodes 2
# --leader-addr A:P --extra-engine-args '{"dp_size": 4, "enable_dp_attention": true}'` with tp 4 in all) and rank 1
# (the same command with --node-rank 1, NATS_SERVER reaching the same NATS) and check that: rank 1 logs that it
# relays dp ranks 2 and 3; a request routed to rank 2 or 3 puts KV events of those ranks, named with runtime/kv/
# blocks.py's hashes, on flotilla.NS.backend.kv_events, and the leader's cache_state(2) holds them; with NATS
# restarted, later events of ranks 2 and 3 arrive again while both nodes serve on.
# It measures nothing: timings of real engines belong in a benchmark of their own.
set -u -o pipefail

MODEL_DIR=${1:?usage: bench/gpu_engines_check.sh MODEL_DIR [vllm] [sglang] [trtllm]}
shift
ENGINES=("$@")
[ ${#ENGINES[@]} -eq 0 ] && ENGINES=(vllm sglang trtllm)
EXTRA_ENGINE_ARGS=${EXTRA_ENGINE_ARGS:-}
export EXTRA_ENGINE_ARGS
PYTHON=${VENV:-.venv}/bin/python
SHARE=${SHARE:-0.4}
PORT=${PORT:-18431}
cd "$(dirname "$0")/.." || exit 1
failed=0

report() {  # report STATUS ENGINE CHECK DETAIL
    echo "$1 $2 $3: $4"
    [ "$1" = FAIL ] && failed=1
    return 0
}

run_check() {  # run_check [VAR=VALUE ...]: the Python check in $check, its output shown; a FAIL line it prints counts
    local out
    out=$(mktemp)
    env "$@" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 900 "$PYTHON" "$check" 2>&1 | tee "$out"
    local status=${PIPESTATUS[0]}
    grep -q "^FAIL " "$out" && failed=1
    rm -f "$out"
    return "$status"
}

for engine in "${ENGINES[@]}"; do
    case $engine in
        vllm) package=vllm ;;
        sglang) package=sglang ;;
        trtllm) package=tensorrt_llm ;;
        *) echo "unknown engine $engine (vllm, sglang or trtllm)"; exit 2 ;;
    esac
    if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$package') is None)"; then
        report SKIP "$engine" install "the $package package is not installed in $PYTHON's environment"
        continue
    fi

    # 1. The engine in this process.
    # From a file, not stdin: vLLM's engine core is a spawned process, which imports the parent's main module.
    check=$(mktemp --suffix=.py)
    cat >"$check" <<'PY'
import asyncio, os, sys

from launcher.options import RunOptions
from launcher.run import build_model
from runtime.engine import RequestContext
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions

engine_name = os.environ["ENGINE"]


def report(status: str, check: str, detail: str) -> None:
    print(f"{status} {engine_name} {check}: {detail}", flush=True)


class ListSink:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, dp_rank: int, events: list) -> None:
        self.events.extend(events)


async def collect(engine, tokens, request_id, max_tokens=16, stop_after=None):
    request = PreprocessedRequest(
        request_id=request_id, model="m", token_ids=tokens, sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=max_tokens), eos_token_ids=[],
    )
    out, finish, cached = [], None, None
    stream = engine.generate(request, RequestContext(request_id))
    async for step in stream:
        out += step.token_ids
        cached = step.cached_tokens if cached is None else cached
        finish = step.finish_reason or finish
        if stop_after is not None and len(out) >= stop_after:
            await stream.aclose()
            break
    return out, finish, cached


async def main() -> int:
    options = RunOptions(
        output=engine_name, model=os.environ["MODEL_DIR"], gpu_memory_utilization=float(os.environ["SHARE"]),
        extra_engine_args=os.environ["EXTRA_ENGINE_ARGS"] or None,
    )
    model, engine = build_model(options)
    await engine.start()
    report("PASS", "start", f"loaded with --gpu-memory-utilization {os.environ['SHARE']}")
    sink = ListSink()
    engine.attach_kv_events(sink)
    card = model.card
    prompt = card.tokenizer.encode("The history of the lighthouse at Alexandria, told in full: " * 8).ids
    try:
        first, finish, _ = await collect(engine, prompt, "a1")
        report("PASS" if first and finish in ("stop", "length") else "FAIL", "greedy", f"{len(first)} tokens, {finish}")
        again, _, cached = await collect(engine, prompt, "a2")
        report("PASS" if again == first else "FAIL", "token-exact", f"second greedy run equal: {again == first}")
        report("PASS" if cached else "FAIL", "prefix reuse", f"cached_tokens {cached} of {len(prompt)}")
        cut, _, _ = await collect(engine, prompt[:40], "b1", max_tokens=200, stop_after=2)
        after, finish, _ = await collect(engine, prompt[:30], "b2")
        report("PASS" if after and finish else "FAIL", "abort", f"abandoned after {len(cut)}; next got {len(after)}")
        await asyncio.sleep(2)  # events are batched by the engine
        stored = [event for event in sink.events if isinstance(event, BlockStored)]
        ours = set(sequence_block_hashes(prompt, engine.block_size))
        named = {h for event in stored for h in event.block_hashes} & ours
        report("PASS" if named else "FAIL", "kv events", f"{len(sink.events)} events, {len(named)} of the prompt's {len(ours)} blocks named")
        state = engine.cache_state(None)
        report("PASS" if any(state.values()) else "FAIL", "cache state", f"{sum(map(len, state.values()))} blocks")
    finally:
        await engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
PY
    run_check ENGINE="$engine" MODEL_DIR="$MODEL_DIR" SHARE="$SHARE"
    status=$?
    rm -f "$check"
    [ $status -eq 0 ] || report FAIL "$engine" in-process "the check above stopped early (see its output)"

    # 2. Through the CLI.
    log=$(mktemp)
    "$PYTHON" -m launcher.cli run in=http out="$engine" "$MODEL_DIR" --http-port "$PORT" \
        --gpu-memory-utilization "$SHARE" ${EXTRA_ENGINE_ARGS:+--extra-engine-args "$EXTRA_ENGINE_ARGS"} >"$log" 2>&1 &
    server=$!
    ready=0
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && { ready=1; break; }
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
    if [ $ready = 1 ]; then
        answer=$(curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
            -d '{"model": "'"$(basename "$MODEL_DIR")"'", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}')
        if echo "$answer" | grep -q '"finish_reason"'; then
            report PASS "$engine" http "chat completion answered"
        else
            report FAIL "$engine" http "answer: $answer"
        fi
    else
        report FAIL "$engine" http "not ready; last log lines: $(tail -3 "$log" | tr '\n' ' ')"
    fi
    kill $server 2>/dev/null; wait $server 2>/dev/null
    rm -f "$log"
    refused=$("$PYTHON" -m launcher.cli run out="$engine" "$MODEL_DIR" --extra-engine-args '{"no_such_key": 1}' 2>&1)
    code=$?
    if [ $code = 2 ] && echo "$refused" | grep -q "no_such_key"; then
        report PASS "$engine" "unknown key" "exit 2 naming it"
    else
        report FAIL "$engine" "unknown key" "exit $code: $refused"
    fi

    # 3. KV offloading to host memory.
    case $engine in
        vllm) offload='{"kv_offloading_size": 1}' ;;
        sglang) offload='{"enable_hierarchical_cache": true, "hicache_write_policy": "write_through"}' ;;
        *) offload= ;;
    esac
    if [ "${OFFLOAD:-1}" = 0 ] || [ -z "$offload" ]; then
        continue
    fi
    check=$(mktemp --suffix=.py)
    cat >"$check" <<'PY'
import asyncio, json, os, sys

from launcher.options import RunOptions
from launcher.run import build_model
from runtime.engine import RequestContext
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions

engine_name = os.environ["ENGINE"]


def report(status: str, check: str, detail: str) -> None:
    print(f"{status} {engine_name} {check}: {detail}", flush=True)


class ListSink:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, dp_rank: int, events: list) -> None:
        self.events.extend(events)


async def main() -> int:
    extra = {**json.loads(os.environ["EXTRA_ENGINE_ARGS"] or "{}"), **json.loads(os.environ["OFFLOAD_ARGS"])}
    options = RunOptions(
        output=engine_name, model=os.environ["MODEL_DIR"], gpu_memory_utilization=float(os.environ["SHARE"]),
        extra_engine_args=json.dumps(extra),
    )
    model, engine = build_model(options)
    await engine.start()
    report("PASS", "offload start", f"loaded with {os.environ['OFFLOAD_ARGS']}")
    sink = ListSink()
    engine.attach_kv_events(sink)
    prompt = model.card.tokenizer.encode("A survey of harbour lights from Pharos to the present day: " * 12).ids
    request = PreprocessedRequest(
        request_id="offload-1", model="m", token_ids=prompt, sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=4), eos_token_ids=[],
    )
    try:
        async for _ in engine.generate(request, RequestContext("offload-1")):
            pass
        ours = set(sequence_block_hashes(prompt, engine.block_size))
        for _ in range(20):  # host copies are written after the GPU's blocks, and the events are batched
            await asyncio.sleep(0.5)
            host = {h for e in sink.events if isinstance(e, BlockStored) and e.medium == "cpu" for h in e.block_hashes}
            if host & ours:
                break
        media = sorted({str(getattr(e, "medium", None)) for e in sink.events})
        report("PASS" if host & ours else "FAIL", "host events", f"{len(host & ours)} of the prompt's {len(ours)} blocks stored on the host tier; media seen {media}")
        tiers = engine.load()[0].tiers or []
        cpu = [tier for tier in tiers if tier.medium == "cpu"]
        report("PASS" if cpu and (cpu[0].used_blocks or 0) > 0 else "FAIL", "tier load", f"{tiers}")
        state = [e for events in engine.cache_state(None).values() for e in events if e.medium == "cpu"]
        report("PASS" if state else "FAIL", "tier state", f"{len(state)} host blocks in cache_state()")
    finally:
        await engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
PY
    run_check ENGINE="$engine" MODEL_DIR="$MODEL_DIR" SHARE="$SHARE" OFFLOAD_ARGS="$offload"
    status=$?
    rm -f "$check"
    [ $status -eq 0 ] || report FAIL "$engine" offload "the offload check above stopped early (see its output)"
done

# 4. SGLang's own behaviour, where the fakes stand in for it in the test suite.
for engine in "${ENGINES[@]}"; do
    [ "$engine" = sglang ] || continue
    "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" || continue
    check=$(mktemp --suffix=.py)
    cat >"$check" <<'PY'
import asyncio, json, os, signal, sys

from launcher.options import RunOptions
from launcher.run import build_model, settled_card
from runtime.engine import RequestContext
from runtime.errors import RequestRejected
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions


def report(status: str, check: str, detail: str) -> None:
    print(f"{status} sglang {check}: {detail}", flush=True)


def request(tokens, request_id, max_tokens=32, **fields):
    stop = StopConditions(max_tokens=max_tokens, min_tokens=fields.pop("min_tokens", 0))
    return PreprocessedRequest(
        request_id=request_id, model="m", token_ids=tokens, sampling=SamplingOptions(temperature=0.0),
        stop_conditions=stop, eos_token_ids=[], **fields,
    )


async def run(engine, given):
    outputs = []
    async for output in engine.generate(given, RequestContext(given.request_id)):
        outputs.append(output)
    return outputs


async def main() -> int:
    options = RunOptions(
        output="sglang", model=os.environ["MODEL_DIR"], gpu_memory_utilization=float(os.environ["SHARE"]),
        extra_engine_args=os.environ["EXTRA_ENGINE_ARGS"] or None,
    )
    model, engine = build_model(options)
    await engine.start()
    card = settled_card(model.card, engine)
    tokenizer = card.tokenizer
    prompt = tokenizer.encode("Write one sentence about lighthouses.").ids
    manager = engine._engine.tokenizer_manager
    try:
        page = engine._engine.server_args.page_size
        ok = engine.block_size == page == card.kv_cache_block_size
        report("PASS" if ok else "FAIL", "page size", f"engine {engine.block_size}, SGLang {page}, card {card.kv_cache_block_size}")
        try:
            await run(engine, request(prompt, "m1", min_tokens=2))
            report("FAIL", "min_tokens", "was not refused")
        except RequestRejected as exc:
            served = await run(engine, request(prompt, "m2", max_tokens=4))
            report("PASS" if "min_tokens" in str(exc) and served else "FAIL", "min_tokens", f"refused: {exc}; next served")
        long_prompt = tokenizer.encode("The keeper climbed the stairs at dusk. " * 600).ids
        task = asyncio.create_task(run(engine, request(long_prompt, "c1", max_tokens=2000)))
        while not manager.rid_to_state:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):
            if not manager.rid_to_state:
                break
            await asyncio.sleep(0.1)
        report("PASS" if not manager.rid_to_state else "FAIL", "cancel before first token", f"SGLang holds {list(manager.rid_to_state)}")
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}
        asked = tokenizer.encode("Describe a lighthouse keeper as JSON with a name and an age: ").ids
        outputs = await run(engine, request(asked, "g1", max_tokens=64, json_schema=json.dumps(schema)))
        text = tokenizer.decode([t for o in outputs for t in o.token_ids])
        try:
            value = json.loads(text)
            ok = isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("age"), int) and set(value) == {"name", "age"}
        except ValueError:
            ok = False
        report("PASS" if ok else "FAIL", "guided json", text[:120])
        outputs = await run(engine, request(prompt, "l1", max_tokens=4, logprobs=2))
        ok = all(o.logprobs is not None and len(o.logprobs) == len(o.token_ids) and len(o.logprobs[0].top) == 2 for o in outputs if o.token_ids)
        report("PASS" if ok else "FAIL", "logprobs", str([o.logprobs for o in outputs][:2]))
        loop = asyncio.get_running_loop()
        drain = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, drain.set)  # as the worker's serve_worker does, after start
        await run(engine, request(prompt, "s1", max_tokens=4))
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.wait_for(drain.wait(), 10)
            report("PASS", "sigterm drain", "the worker's handler ran; SGLang's did not take over")
        except TimeoutError:
            report("FAIL", "sigterm drain", "the worker's SIGTERM handler did not run")
        loop.remove_signal_handler(signal.SIGTERM)
    finally:
        await engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
PY
    run_check MODEL_DIR="$MODEL_DIR" SHARE="$SHARE"
    status=$?
    rm -f "$check"
    [ $status -eq 0 ] || report FAIL sglang behaviour "the SGLang check above stopped early (see its output)"
done
# 5. LoRA adapters loaded and unloaded at run time, under load.
for engine in "${ENGINES[@]}"; do
    [ "${LORA:-1}" = 0 ] && break
    case $engine in vllm) package=vllm ;; sglang) package=sglang ;; trtllm) package=tensorrt_llm ;; esac
    "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$package') is None)" || continue
    check=$(mktemp --suffix=.py)
    cat >"$check" <<'PY'
import asyncio, os, sys, tempfile
from pathlib import Path

from launcher.options import RunOptions
from launcher.run import build_model, settled_card
from runtime.engine import RequestContext
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored
from runtime.lora import lora_id, lora_root_hash
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.engines.peft_adapter import write_peft_adapter

engine_name = os.environ["ENGINE"]


def report(status: str, check: str, detail: str) -> None:
    print(f"{status} {engine_name} lora {check}: {detail}", flush=True)


class ListSink:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, dp_rank: int, events: list) -> None:
        self.events.extend(events)


def request(tokens, request_id, max_tokens=16, lora_name=None):
    return PreprocessedRequest(
        request_id=request_id, model="m", token_ids=tokens, sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=max_tokens), eos_token_ids=[], lora_name=lora_name,
    )


async def answer(engine, given):
    tokens = []
    async for step in engine.generate(given, RequestContext(given.request_id)):
        tokens += step.token_ids
    return tokens


async def main() -> int:
    folder = Path(tempfile.mkdtemp(prefix="flotilla-lora-"))
    adapter = write_peft_adapter(Path(os.environ["MODEL_DIR"]), folder / "sql", scale=0.5)
    lora_file = folder / "adapters.json"
    lora_file.write_text('{"adapters": [], "generation": 0}')
    options = RunOptions(
        output=engine_name, model=os.environ["MODEL_DIR"], gpu_memory_utilization=float(os.environ["SHARE"]),
        extra_engine_args=os.environ["EXTRA_ENGINE_ARGS"] or None, lora_file=lora_file,
    )
    model, engine = build_model(options)
    await engine.start()
    sink = ListSink()
    if hasattr(engine, "attach_kv_events"):
        engine.attach_kv_events(sink)
    card = settled_card(model.card, engine)
    # Several KV blocks long, so that the adapter's blocks are stored and named.
    prompt = card.tokenizer.encode("The keeper climbed the stairs of the lighthouse at dusk. " * 12).ids
    try:
        report("PASS" if engine.max_loras >= 1 else "FAIL", "enabled", f"max_loras {engine.max_loras}")
        base = await answer(engine, request(prompt, "b0"))
        load = [asyncio.create_task(answer(engine, request(prompt, f"b{i}", max_tokens=64))) for i in range(1, 9)]
        await engine.load_lora("sql", adapter)
        results = await asyncio.gather(*load, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        report("PASS" if not failures else "FAIL", "load under load", f"{len(results)} base requests, failures {failures[:2]}")
        sink.events.clear()
        adapted = await answer(engine, request(prompt, "a1", lora_name="sql"))
        again = await answer(engine, request(prompt, "b9"))
        report("PASS" if adapted != base and again == base else "FAIL", "answers", f"base {base[:6]}, adapter {adapted[:6]}, base again {again[:6]}")
        if engine_name == "vllm":
            await asyncio.sleep(0.5)
            stored = [e for e in sink.events if isinstance(e, BlockStored)]
            ours = [e for e in stored if e.lora_id == lora_id("sql")]
            size = engine.block_size
            want = sequence_block_hashes(prompt[: len(prompt) // size * size], size, parent=lora_root_hash(lora_id("sql")))
            named = [h for e in ours for h in e.block_hashes]
            ok = bool(ours) and named[: len(want)] == want
            report("PASS" if ok else "FAIL", "kv events", f"{len(ours)} adapter event(s), names {named[:2]} want {want[:2]}")
        running = asyncio.create_task(answer(engine, request(prompt, "a2", max_tokens=512, lora_name="sql")))
        await asyncio.sleep(0.2)
        await engine.unload_lora("sql")
        ended = await asyncio.gather(running, return_exceptions=True)
        try:
            await answer(engine, request(prompt, "a3", lora_name="sql"))
            report("FAIL", "unload", f"a request for the unloaded adapter was served (the running one: {type(ended[0]).__name__})")
        except Exception as exc:
            report("PASS", "unload", f"the running one ended ({type(ended[0]).__name__}); a new one refused: {exc}")
        await engine.load_lora("sql", adapter)
        reloaded = await answer(engine, request(prompt, "a4", lora_name="sql"))
        report("PASS" if reloaded == adapted else "FAIL", "reload", f"{reloaded[:6]} vs {adapted[:6]}")
    finally:
        await engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
PY
    run_check ENGINE="$engine" MODEL_DIR="$MODEL_DIR" SHARE="$SHARE"
    status=$?
    rm -f "$check"
    [ $status -eq 0 ] || report FAIL "$engine" lora "the LoRA check above stopped early (see its output)"
done
exit $failed
