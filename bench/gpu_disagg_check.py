"""Disaggregated prefill/decode with vLLM on one GPU: what the CPU-only suite cannot run (its CPU build runs only
ExampleConnector, which tests/engines/test_vllm_distributed.py covers).

    .venv/bin/python bench/gpu_disagg_check.py MODEL_DIR [--connector nixl|example] [--share 0.3] [--extra JSON]

(On vLLM's CPU build, to try the script itself: ``--connector example --extra '{"block_size": 32, "dtype":
"float32", "enforce_eager": true}'`` with ``VLLM_CPU_KVCACHE_SPACE=1``.)

Two vLLM engines in this process, as two workers build them (launcher.run.build_model with --disagg-role), each
with ``--gpu-memory-utilization SHARE``: a prefill engine and a decode engine whose own prefix cache is off (so
that only the connector can give it a prompt's KV). With ``nixl`` (the default) both use ``NixlConnector``
(``kv_role`` ``kv_both``, each its own side-channel port), which needs the ``nixl`` package. It prints one
``PASS|FAIL|SKIP disagg CHECK: detail`` line per check and exits 1 on a FAIL:

1. both engines start with their connector;
2. the decode engine's greedy answer to a prompt it computes itself (the reference);
3. the prefill engine computes the same prompt as a prefill-only request and ends with a handoff (for NIXL,
   ``kv_transfer_params`` naming its blocks);
4. the decode engine, given that handoff, answers exactly the reference (token for token);
5. it loaded the prompt's KV through its connector rather than computing it again: the text alone would not
   show that ("kv-loaded", from its scheduler stats). With ``--connector example`` this says less: ExampleConnector
   stores what an engine computes whatever its role, so the decode engine's own reference run leaves the prompt's
   KV in the store (the prefill engine's handoff then says 96 of 98 tokens cached), and what the decode engine
   loads may be its own. bench/gpu_disagg_stack_check.py, whose reference is another stack, has no such doubt.

It measures nothing; the ingress side of the same path runs on the CPU in tests/distributed/test_disagg_mocker.py.
"""

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.options import RunOptions
from launcher.run import build_model
from runtime.engine import RequestContext
from runtime.protocol import KvHandoff, PreprocessedRequest, SamplingOptions, StopConditions

failed = False
#: 98 tokens with SmolLM2's tokenizer. Not one more than a whole number of blocks: vLLM's ExampleConnector stores a
#: prompt's KV under its first (n - 1) // block * block tokens and looks it up under those of n - 1 tokens (it expects
#: the decode side's prompt to carry the first token too), which differ when n - 1 is a whole number of blocks. At
#: 97 tokens its decode worker found nothing and computed the prompt again: only "kv-loaded" showed it.
PROMPT = "The history of the lighthouse at Alexandria, told in full: " * 8 + "It begins"


def report(status: str, check: str, detail: str) -> None:
    global failed
    failed |= status == "FAIL"
    print(f"{status} disagg {check}: {detail}", flush=True)


def request(tokens: list[int], request_id: str, **fields: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id, model="m", token_ids=tokens, sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=24), eos_token_ids=[], **fields,
    )  # fmt: skip


async def answer(engine: Any, req: PreprocessedRequest) -> tuple[list[int], KvHandoff | None]:
    tokens: list[int] = []
    handoff = None
    async for output in engine.generate(req, RequestContext(req.request_id)):
        tokens += output.token_ids
        handoff = output.handoff or handoff
    return tokens, handoff


async def connector_tokens_since(engine: Any, before: int) -> int:
    """The connector's tokens an engine was given since ``before``; its stats come after each step, so a second
    is given for the last one's."""
    for _ in range(20):
        if engine.connector_hit_tokens() > before:
            break
        await asyncio.sleep(0.1)
    return int(engine.connector_hit_tokens() - before)


def connector(kind: str, role: str, store: str) -> dict[str, Any]:
    if kind == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"shared_storage_path": store},
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--connector", choices=["nixl", "example"], default="nixl")
    parser.add_argument("--share", type=float, default=0.3, help="each engine's --gpu-memory-utilization")
    parser.add_argument("--extra", default="{}", help="more --extra-engine-args for both engines (a JSON object)")
    args = parser.parse_args()
    if args.connector == "nixl" and importlib.util.find_spec("nixl") is None:
        report("SKIP", "nixl", "the nixl package is not installed (pip install nixl, or carry its wheel)")
        return 0
    store = tempfile.mkdtemp(prefix="kv-store-")
    engines = {}
    for number, role in enumerate(("prefill", "decode")):
        # Each engine core reads its NIXL side-channel port from the environment it is spawned with.
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(5600 + 10 * number)
        extra = {**json.loads(args.extra), "kv_transfer_config": connector(args.connector, role, store)}
        if role == "decode":
            extra["enable_prefix_caching"] = False
        options = RunOptions(
            output="vllm", model=args.model_dir, gpu_memory_utilization=args.share, disagg_role=role,
            extra_engine_args=json.dumps(extra),
        )  # fmt: skip
        model, engine = build_model(options)
        await engine.start()
        engines[role] = (model, engine)
    report("PASS", "start", f"a prefill and a decode engine with {args.connector}, {args.share} of the GPU each")
    (model, prefill), (_, decode) = engines["prefill"], engines["decode"]
    try:
        prompt = model.card.tokenizer.encode(PROMPT).ids
        reference, _ = await answer(decode, request(prompt, "reference"))
        report("PASS" if reference else "FAIL", "reference", f"{len(reference)} tokens computed on the decode engine")
        _, handoff = await answer(prefill, request(prompt, "prefill", prefill_only=True))
        has_params = handoff is not None and (bool(handoff.params) or args.connector == "example")
        report("PASS" if has_params else "FAIL", "handoff", f"{handoff}")
        if handoff is not None:
            before = decode.connector_hit_tokens()
            handed, _ = await answer(decode, request(prompt, "decode", handoff=handoff))
            same = handed == reference
            report("PASS" if same else "FAIL", "token-exact", f"decoded from the handoff equals the reference: {same}")
            loaded = await connector_tokens_since(decode, before)
            ok = loaded >= len(prompt) / 2  # vLLM computes at least the last token (some connectors a last block)
            detail = f"the decode engine loaded {loaded} of the prompt's {len(prompt)} tokens through its connector"
            report("PASS" if ok else "FAIL", "kv-loaded", detail)
    finally:
        for _, engine in engines.values():
            await engine.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
