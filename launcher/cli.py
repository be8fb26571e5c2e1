"""The ``flotilla`` command line.

``flotilla run in=<input> out=<engine> [MODEL] [options]``: every option also reads an environment
variable (shown in ``--help``), so the same settings work from a systemd unit or a container. Its flags
are launcher/run_parser.py's; here they are checked together and become a RunOptions.
"""

import argparse
import sys
from typing import TypeVar

from engines.echo import echo_delay_seconds
from engines.python_file import python_engine_file
from engines.shared.node_group import MULTINODE_ENGINES, NodeGroup
from frontend_gateway.openai_api.image_limits import ImageLimits
from frontend_gateway.routing.disagg_policy import DisaggMode, DisaggPolicy
from launcher.env_flags import EnvArgumentParser
from launcher.options import ENGINES, EXTRA_ARGS_ENGINES, RunOptions
from launcher.proctitle import run_title, set_title
from launcher.run_parser import build_run_parser
from launcher.worker_tree import mark_own_tree, start_guard
from runtime.cluster.addressing import EndpointAddress
from runtime.config import check_hub_variables, env_str
from runtime.errors import ConfigError, FlotillaError, ModelError, ModelUnreachable, TemplateError
from runtime.fleet_contract.engine_names import DISAGG_ENGINES, GPU_ONLY_ENGINES, LORA_ENGINES
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_QUEUED_PREFILL_WEIGHT,
    PipelineRouter,
)
from runtime.logging import configure_logging
from runtime.settings import check_settings

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
        namespace.kv_host_hit_weight,
        namespace.kv_disk_hit_weight,
    )
    if all(value is None for value in given):
        return None
    return PipelineRouter(
        mode=namespace.router_mode or "round-robin",
        overlap_score_weight=_or(namespace.kv_overlap_score_weight, 1.0),
        queued_prefill_weight=_or(namespace.kv_queued_prefill_weight, DEFAULT_QUEUED_PREFILL_WEIGHT),
        temperature=_or(namespace.router_temperature, 0.0),
        use_kv_events=_or(namespace.use_kv_events, True),
        host_hit_weight=_or(namespace.kv_host_hit_weight, DEFAULT_HOST_HIT_WEIGHT),
        disk_hit_weight=_or(namespace.kv_disk_hit_weight, DEFAULT_DISK_HIT_WEIGHT),
        disagg_policy=namespace.disagg_policy,
        disagg_isl_threshold=namespace.disagg_isl_threshold,
        disagg_isl_ratio=namespace.disagg_isl_ratio,
        disagg_prefill_busy=namespace.disagg_prefill_busy,
        disagg_decode_busy=namespace.disagg_decode_busy,
        generation=_or(namespace.router_generation, 0),
    )


TOP_HELP = """\
usage: flotilla COMMAND [options]

Flotilla: serve language models.

commands:
  run    run a model and talk to it (text, HTTP or batch); `flotilla run --help` for more
  up     the whole stack on this machine: servers, control plane, agent, gateway, a first model
  agent  this machine's node agent: runs the control plane's workers; `flotilla agent --help` for more
  profile  measure a model's capacity on an engine: the planner's profile; `flotilla profile --help` for more
"""


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
    if namespace.mmproj is not None and output != "llamacpp":
        parser.error(
            f"--mmproj (FLOTILLA_MMPROJ) gives llama.cpp a projector for images; out={output} does not take one "
            "(out=vllm reads a vision model's own folder)"
        )
    if namespace.extra_engine_args is not None and output not in EXTRA_ARGS_ENGINES:
        engines = " or ".join(f"out={engine}" for engine in EXTRA_ARGS_ENGINES)
        parser.error(f"--extra-engine-args (FLOTILLA_EXTRA_ENGINE_ARGS) configures {engines}, not out={output}")
    if namespace.api_keys_secret_file is not None and output != "dyn":
        parser.error(
            "--api-keys-secret-file (FLOTILLA_API_KEYS_SECRET_FILE) is for the ingress (in=http out=dyn): API keys "
            f"come from the control plane through etcd, which out={output} does not watch"
        )
    if namespace.control_plane is not None and output != "dyn":
        parser.error(
            "--control-plane (FLOTILLA_CONTROL_PLANE) is for the ingress (in=http out=dyn): it passes the Batch "
            f"API on to the control plane, which out={output} has none of"
        )
    if namespace.allowed_origins and input_ != "http":
        parser.error(
            f"--allowed-origins (FLOTILLA_ALLOWED_ORIGINS) lets web pages call the HTTP API; in={input_} serves none"
        )
    if namespace.quota_redis is not None and namespace.api_keys_secret_file is None:
        parser.error("--quota-redis (FLOTILLA_QUOTA_REDIS_URL) counts API keys' use: give --api-keys-secret-file too")
    if namespace.max_concurrent_per_key is not None and namespace.api_keys_secret_file is None:
        parser.error(
            "--max-concurrent-per-key (FLOTILLA_MAX_CONCURRENT_PER_KEY) caps API keys' requests: give "
            "--api-keys-secret-file too"
        )
    if namespace.metrics_port is not None and not (input_.startswith("dyn://") or input_ == "http"):
        parser.error(
            f"--metrics-port (FLOTILLA_METRICS_PORT) is a worker's (in=dyn://...) or an ingress's (in=http); "
            f"in={input_} has no /metrics"
        )
    if namespace.metrics_port is not None and input_ == "http" and namespace.metrics_port == namespace.http_port:
        parser.error(f"--metrics-port {namespace.metrics_port} is --http-port's: give the metrics a port of their own")
    if namespace.disagg_role not in (None, "aggregated"):
        if not input_.startswith("dyn://"):
            parser.error(
                f"--disagg-role (FLOTILLA_DISAGG_ROLE) {namespace.disagg_role} is a worker's (in=dyn://...): "
                f"in={input_} serves whole requests"
            )
        if output not in DISAGG_ENGINES:
            parser.error(
                f"--disagg-role (FLOTILLA_DISAGG_ROLE) {namespace.disagg_role}: out={output} cannot hand a prompt's "
                f"KV cache to another worker yet; engines that can: {', '.join(DISAGG_ENGINES)}"
            )
    _check_loras(parser, namespace, input_, output)
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
        allowed_origins=namespace.allowed_origins,
        header_timeout_s=namespace.header_timeout,
        body_timeout_s=namespace.body_timeout,
        send_timeout_s=namespace.send_timeout,
        image_limits=ImageLimits(
            max_bytes=namespace.max_image_bytes,
            fetch_timeout_s=namespace.image_fetch_timeout,
            domains=namespace.image_domains,
        ),
        threads=namespace.threads,
        parallel=namespace.parallel,
        mmproj=namespace.mmproj,
        batch_concurrency=namespace.batch_concurrency,
        max_tokens=namespace.max_tokens,
        temperature=namespace.temperature,
        router_mode=namespace.router_mode or "round-robin",
        kv_overlap_score_weight=_or(namespace.kv_overlap_score_weight, 1.0),
        kv_queued_prefill_weight=_or(namespace.kv_queued_prefill_weight, DEFAULT_QUEUED_PREFILL_WEIGHT),
        router_temperature=_or(namespace.router_temperature, 0.0),
        use_kv_events=_or(namespace.use_kv_events, True),
        kv_host_hit_weight=_or(namespace.kv_host_hit_weight, DEFAULT_HOST_HIT_WEIGHT),
        kv_disk_hit_weight=_or(namespace.kv_disk_hit_weight, DEFAULT_DISK_HIT_WEIGHT),
        worker_router=_worker_router(namespace),
        router_ttl_s=namespace.router_ttl,
        busy_kv_usage=namespace.busy_kv_usage,
        busy_waiting=namespace.busy_waiting,
        tensor_parallel_size=namespace.tensor_parallel_size or 1,
        base_gpu_id=namespace.base_gpu_id,
        gpu_memory_utilization=namespace.gpu_memory_utilization,
        router_replica_sync=namespace.router_replica_sync,
        disagg_policy=DisaggPolicy(
            mode=DisaggMode(namespace.disagg_policy),
            isl_threshold=namespace.disagg_isl_threshold,
            isl_ratio=namespace.disagg_isl_ratio,
            prefill_busy=namespace.disagg_prefill_busy,
            decode_busy=namespace.disagg_decode_busy,
        ),
        migration_limit=namespace.migration_limit,
        progress_deadline_s=namespace.progress_deadline,
        max_inflight=namespace.max_inflight,
        max_queued=namespace.max_queued,
        queue_timeout_s=namespace.queue_timeout,
        reuse_port=namespace.reuse_port,
        api_keys_secret_file=namespace.api_keys_secret_file,
        quota_redis_url=namespace.quota_redis,
        control_plane_url=namespace.control_plane,
        max_concurrent_per_key=namespace.max_concurrent_per_key,
        extra_engine_args=namespace.extra_engine_args,
        labels=namespace.labels or {},
        disagg_role=namespace.disagg_role or "aggregated",
        metrics_port=namespace.metrics_port,
        loras=tuple(namespace.lora or ()),
        lora_file=namespace.lora_file,
        num_nodes=nodes.num_nodes,
        node_rank=nodes.node_rank,
        leader_addr=nodes.leader,
    )


def _check_loras(parser: EnvArgumentParser, namespace: argparse.Namespace, input_: str, output: str) -> None:
    """parser.error() for adapters given to an engine that takes none, outside a worker, or one name twice."""
    adapters = namespace.lora or []
    if not adapters and namespace.lora_file is None:
        return
    flag = "--lora (FLOTILLA_LORA)" if adapters else "--lora-file (FLOTILLA_LORA_FILE)"
    if output not in LORA_ENGINES:
        engines = ", ".join(f"out={engine}" for engine in LORA_ENGINES)
        parser.error(f"{flag}: out={output} does not load LoRA adapters; engines that do: {engines}")
    if not (input_.startswith("dyn://") or input_ == "http"):
        parser.error(f"{flag}: adapters are served by a worker (in=dyn://...) or in=http, not in={input_}")
    names = [adapter.name for adapter in adapters]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        parser.error(f"--lora (FLOTILLA_LORA): adapter {twice[0]!r} is given twice")


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


#: The engines that start processes of their own (an engine core, ranks, a scheduler): a `flotilla run` of one,
#: started by hand, marks its tree and has a guard end it when it dies (launcher/worker_tree.py). The others run
#: in the process itself and leave nothing behind (a Python engine, pystr or pytok, is code of its own that may
#: start processes).
ENGINES_WITH_PROCESSES = frozenset({"vllm", "sglang", "trtllm"})


def _starts_processes(output: str) -> bool:
    """Whether engine ``output`` may start processes of its own (see ENGINES_WITH_PROCESSES)."""
    return output in ENGINES_WITH_PROCESSES or python_engine_file(output) is not None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flotilla`` console script. Returns the process exit code (see EXIT_CODES)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(TOP_HELP, end="")
        return EXIT_OK if args else EXIT_CONFIG
    try:
        check_hub_variables()  # before any command imports huggingface_hub, which would raise at import
    except ConfigError as exc:
        print(f"flotilla: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args[0] == "up":
        from launcher.stack.up import main as up

        return up(args[1:])
    if args[0] == "agent":
        from launcher.agent_command import agent_main

        return agent_main(args[1:])
    if args[0] == "profile":
        from launcher.profile import profile_main

        return profile_main(args[1:])
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
        if argv is None and _starts_processes(options.output):
            # A program of its own whose engine starts processes (which hold the GPU): none may outlive it.
            # Only these engines pay for the mark (this program executed again) and the guard process.
            mark_own_tree()
            start_guard()
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
