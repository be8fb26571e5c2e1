"""Disaggregated prefill/decode through the whole serving path, for vLLM, SGLang or TensorRT-LLM on one GPU: what
the CPU-only suite runs against stand-ins (SGLang's and TensorRT-LLM's) or with vLLM's CPU-only connector.

    VENV/bin/python bench/gpu_disagg_stack_check.py MODEL_DIR --engine vllm|sglang|trtllm [--share 0.3]
        [--extra JSON] [--timeout 900]
    .venv/bin/python bench/gpu_disagg_stack_check.py --engine mocker     # the same path without a GPU

Two stacks in turn (bench/stacks.py's ``worker_stack``: etcd, NATS, the ingress and ``flotilla run`` workers,
each engine given ``--gpu-memory-utilization SHARE``), as a fleet runs them (docs/disaggregation.md):

1. one aggregated worker answers a greedy completion (temperature 0, 24 tokens): the reference;
2. a prefill worker and a decode worker. The same completion, sent with ``x-flotilla-disagg: remote`` (the prompt
   must be computed on the prefill worker), names the prefill worker in ``x-flotilla-prefill-instance`` and the
   decode worker in ``x-flotilla-instance``, and its text is the reference's;
3. each worker's own ``/metrics`` (``--metrics-port``) counts it: one prompt computed for a decode worker on the
   prefill worker, one KV handoff taken on the decode worker ("handoff");
4. vLLM only: the decode worker loaded the prompt's KV through its connector rather than computing it again
   ("kv-loaded": its ``vllm:external_prefix_cache_hits`` against its ``vllm:prompt_tokens``). A decode worker
   that ignored the transfer and recomputed the prompt would still answer the same text, which is why the
   text alone does not show the transfer. SGLang's and TensorRT-LLM's decode workers cannot compute a prompt
   in their disaggregation modes: the text shows it for them.

Each engine moves the KV its own way, set here in its engine args (``--extra`` adds to them or replaces them):

* vLLM: ``NixlConnector`` (``kv_role`` ``kv_both``), each worker with its own NIXL side-channel port; it needs
  the ``nixl`` package. ``--connector example`` uses ``ExampleConnector`` (files in a folder) instead, the one
  vLLM's CPU build runs: with ``--share 0 --extra '{"block_size": 32, "dtype": "float32", "enforce_eager":
  true}'`` and ``VLLM_CPU_KVCACHE_SPACE=1`` it tries this script on a CPU.
* SGLang: its disaggregation with the ``nixl`` transfer backend (``--extra '{"disaggregation_transfer_backend":
  "mooncake"}'`` for Mooncake); the prefill worker's bootstrap server on its default port.
* TensorRT-LLM: its cache transceiver (``cache_transceiver_config`` backend ``DEFAULT``).
* the mocker (``--engine mocker``, SmolLM2's GGUF when no model is given): the script's own path on any machine,
  as CI smoke-runs it. Its tokens follow the request's seed, which the completion sets, so that its decode
  worker's answer from a handoff is the aggregated worker's too.

It prints one ``PASS|FAIL|SKIP disagg-stack CHECK: detail`` line per check and exits 1 on a FAIL. It measures
nothing; tests/distributed/test_disagg_mocker.py runs the same path on the CPU with mocker workers.
"""

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import free_port
from gpu_disagg_check import PROMPT
from overload import smollm2_path
from prometheus_client.parser import text_string_to_metric_families
from stacks import StackWorker, worker_stack

MODEL = "disagg-check"
#: The mocker's settings here: its steps ten times faster than a GPU's.
MOCKER_SETTINGS = {"speedup_ratio": 10.0}
#: Where vLLM's NIXL side channels listen, one port a worker from here.
NIXL_SIDE_CHANNEL_PORT = 5600

failed = False


def report(status: str, check: str, detail: str) -> None:
    global failed
    failed |= status == "FAIL"
    print(f"{status} disagg-stack {check}: {detail}", flush=True)


def transfer_settings(engine: str, connector: str, role: str, store: Path) -> dict[str, Any]:
    """The engine args that make ``engine`` move a prompt's KV between a prefill and a decode worker."""
    if engine == "vllm":
        if connector == "nixl":
            return {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        extra_config = {"shared_storage_path": str(store)}
        return {
            "kv_transfer_config": {
                "kv_connector": "ExampleConnector",
                "kv_role": kv_role,
                "kv_connector_extra_config": extra_config,
            }
        }
    if engine == "sglang":
        return {"disaggregation_transfer_backend": "nixl"}
    if engine == "trtllm":
        return {"cache_transceiver_config": {"backend": "DEFAULT"}}
    return {}


def worker(args: argparse.Namespace, role: str, settings: dict[str, Any], number: int) -> StackWorker:
    own = MOCKER_SETTINGS if args.engine == "mocker" else {}
    engine_args = json.dumps({**own, **settings, **json.loads(args.extra)})
    flags = ["--extra-engine-args", engine_args]
    if args.share > 0 and args.engine != "mocker":
        flags += ["--gpu-memory-utilization", str(args.share)]
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT + 10 * number)} if args.engine == "vllm" else {}
    return StackWorker(role, (f"out={args.engine}", args.model_dir, *flags), env)


def complete(base_url: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "seed": 11}
    return httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=300)


def metrics(port: int) -> dict[str, float]:
    """A worker's /metrics as sample name -> value, summed over labels (an empty dict when it does not answer)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def check_counted(engine: str, ports: dict[str, int], before: dict[str, dict[str, float]]) -> None:
    """The "handoff" and "kv-loaded" checks, from each worker's own metrics over the one remote completion (their
    values ``before`` it taken away)."""

    def grown(role: str, now: dict[str, float], name: str) -> float:
        return now.get(name, 0.0) - before[role].get(name, 0.0)

    deadline = time.monotonic() + 10  # the phase counters come with the load report, once a second
    while True:
        decode, prefill = metrics(ports["decode"]), metrics(ports["prefill"])
        handoffs = grown("decode", decode, "flotilla_worker_kv_handoffs_total")
        prefills = grown("prefill", prefill, "flotilla_worker_prefills_total")
        if (handoffs >= 1 and prefills >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    counted = handoffs == 1 and prefills == 1
    detail = f"the prefill worker computed {prefills:g} prompt(s) for a decode worker, the decode worker took "
    report("PASS" if counted else "FAIL", "handoff", detail + f"{handoffs:g} handoff(s) (1 and 1 expected)")
    if engine != "vllm":
        why = "the text shows it" if engine != "mocker" else "the mocker's decode worker is timed, not computed"
        report("SKIP", "kv-loaded", f"{engine}: no connector counter to read; {why}")
        return
    prompt = grown("decode", decode, "vllm:prompt_tokens_total")
    loaded = grown("decode", decode, "vllm:external_prefix_cache_hits_total")
    # vLLM computes at least the prompt's last token itself (and a partial last block, for some connectors).
    ok = prompt > 0 and loaded >= prompt / 2
    detail = f"the decode worker loaded {loaded:g} of its {prompt:g} prompt tokens through the connector"
    if not ok:
        queried = grown("decode", decode, "vllm:external_prefix_cache_queries_total")
        local = grown("decode", decode, "vllm:prefix_cache_hits_total")
        detail += f" (asked it for {queried:g}; found {local:g} in its own prefix cache)"
    report("PASS" if ok else "FAIL", "kv-loaded", detail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "model_dir", nargs="?", help="a Hugging Face model folder (safetensors); the mocker: SmolLM2's GGUF if none"
    )
    parser.add_argument("--engine", choices=["vllm", "sglang", "trtllm", "mocker"], required=True)
    parser.add_argument("--connector", choices=["nixl", "example"], default="nixl", help="vLLM's KV connector")
    parser.add_argument("--share", type=float, default=0.3, help="each engine's GPU memory share (0: not given)")
    parser.add_argument("--extra", default="{}", help="more engine args for every worker (a JSON object)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a stack may take to come up")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the stacks' logs here (default: not kept)")
    args = parser.parse_args()
    if args.model_dir is None:
        if args.engine != "mocker":
            parser.error(f"give the model folder {args.engine} serves (MODEL_DIR)")
        args.model_dir = str(smollm2_path())
    package = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm", "mocker": "engines"}[args.engine]
    if importlib.util.find_spec(package) is None:
        report("SKIP", "engine", f"{args.engine} is not installed in this interpreter ({sys.executable})")
        return 0
    if args.engine in ("vllm", "sglang") and args.connector == "nixl" and importlib.util.find_spec("nixl") is None:
        report("SKIP", "nixl", "the nixl package is not installed (pip install nixl, or carry its wheel)")
        return 0
    with contextlib.ExitStack() as cleanup:
        if args.log_dir is None:
            logs = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="disagg-stack-")))
        else:
            logs = args.log_dir
        return check(args, logs)


def check(args: argparse.Namespace, logs: Path) -> int:
    """The two stacks' checks, their logs under ``logs``; the exit code."""
    store = logs / "kv-store"
    store.mkdir(parents=True, exist_ok=True)

    with worker_stack(
        [worker(args, "", {}, 0)], directory=logs / "aggregated", model=MODEL, ready_timeout_s=args.timeout
    ) as stack:
        alone = complete(stack.base_url, {})
    reference = alone.json()["choices"][0]["text"] if alone.status_code == 200 else None
    report("PASS" if reference else "FAIL", "reference", f"an aggregated worker answered {alone.status_code}")
    if reference is None:
        print(alone.text[:2000])
        return 1

    roles = ("decode", "prefill")  # worker_stack's order: the decode worker's id first
    metrics_ports = {role: free_port() for role in roles}
    pair = [
        worker(args, role, transfer_settings(args.engine, args.connector, role, store), number + 1)
        for number, role in enumerate(roles)
    ]
    pair = [StackWorker(one.role, (*one.args, "--metrics-port", str(metrics_ports[one.role])), one.env) for one in pair]
    with worker_stack(pair, directory=logs / "disaggregated", model=MODEL, ready_timeout_s=args.timeout) as stack:
        decode_id, prefill_id = stack.worker_ids
        share = f"{args.share} of the GPU each" if args.share > 0 and args.engine != "mocker" else "no GPU share given"
        report("PASS", "start", f"{args.engine}: a prefill and a decode worker, {share}")
        before = {role: metrics(port) for role, port in metrics_ports.items()}  # the stack's own probes count
        handed = complete(stack.base_url, {"x-flotilla-disagg": "remote"})
        if handed.status_code == 200:
            check_counted(args.engine, metrics_ports, before)
    if handed.status_code != 200:
        report("FAIL", "remote", f"the disaggregated completion answered {handed.status_code}: {handed.text[:500]}")
        return 1
    named = (handed.headers.get("x-flotilla-prefill-instance"), handed.headers.get("x-flotilla-instance"))
    on_both = named == (prefill_id, decode_id)
    detail = f"prefilled by {named[0]}, decoded by {named[1]} (the prefill worker {prefill_id}, decode {decode_id})"
    report("PASS" if on_both else "FAIL", "remote", detail)
    text = handed.json()["choices"][0]["text"]
    same = text == reference
    report("PASS" if same else "FAIL", "token-exact", f"{text!r} {'==' if same else '!='} {reference!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
