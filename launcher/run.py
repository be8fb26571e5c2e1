"""``flotilla run``: compose one input (``in=``) with one engine (``out=``) in a single process."""

import asyncio
import importlib.util
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from engines.echo import EchoCoreEngine, EchoFullEngine, echo_delay_seconds
from engines.python_file import PyStrEngine, PyTokEngine, load_generate, python_engine_file
from frontend_gateway.models.pipeline import ModelRegistry, ServedModel, TextModel, TokenModel
from launcher import heap
from launcher.options import ENGINES, RunOptions
from runtime.cluster.addressing import EndpointAddress
from runtime.engine import Engine, TextEngine
from runtime.errors import ConfigError
from runtime.models.card import ModelCard, ModelType

if TYPE_CHECKING:
    from engines.mocker.config import MockerConfig
    from frontend_gateway.access.api_keys import KeyTable
    from frontend_gateway.access.quotas import Meter
    from frontend_gateway.metrics import GatewayMetrics
    from runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)

#: What an ingress without --api-keys-secret-file says as it starts: anyone who reaches it may use it.
OPEN_INGRESS_WARNING = (
    "API keys are off: /v1/* is served to anyone who can reach this ingress, with no key. To require keys, "
    "start it with --api-keys-secret-file FILE (FLOTILLA_API_KEYS_SECRET_FILE), FILE being a copy of the "
    "control plane's signing secret (api-keys.secret in its data directory), and make keys in the control "
    "plane (the dashboard's API keys page, or POST /api/v1/api-keys/)"
)


def load_card(options: RunOptions) -> tuple[ModelCard, Path]:
    """Resolve the model argument (downloading if needed) and read its card."""
    # Imported here: echo_full needs no model, and these pull in gguf and huggingface_hub.
    from runtime.models.loading import load_model_card
    from runtime.models.source import resolve_model

    path = resolve_model(options.model)
    card = load_model_card(
        path,
        model_config=options.model_config,
        name=options.model_name,
        context_length=options.context_length,
    )
    # On the card, so that an ingress serving this worker's model parses its answers the same way.
    # The engine too, named in the refusals of what it cannot do (echo with logprobs on the mocker, say).
    card = card.replace(
        reasoning_parser=options.reasoning_parser, tool_call_parser=options.tool_call_parser, engine=options.output
    )
    return card, path


def build_model(options: RunOptions) -> tuple[ServedModel, Engine]:
    """The served model and its (not yet started) engine for ``options.output``."""
    output = options.output
    if output == "echo_full":
        full = EchoFullEngine(echo_delay_seconds())
        return text_model(options.model_name or "echo", full, options), full
    if output == "echo_core":
        card, _ = load_card(options)
        core = EchoCoreEngine(echo_delay_seconds())
        return TokenModel(card, core), core
    if output == "llamacpp":
        from engines.llamacpp.engine import LlamaCppEngine
        from engines.llamacpp.guided import GUIDED_KINDS

        card, path = load_card(options)
        # With a projector, images: the template is given them as text, the gateway tokenizes around them.
        if options.mmproj is not None:
            from engines.llamacpp.vision import projector_card_fields

            vocabulary = card.tokenizer.get_vocab_size(with_added_tokens=True)
            card = card.replace(**projector_card_fields(options.mmproj, n_vocab=vocabulary))
        # Structured output and guided decoding by llama.cpp's grammars; log probabilities (of the prompt too)
        # from its logits; embeddings from a second context in embedding mode.
        card = card.replace(
            structured_output=True,
            guided_decoding=GUIDED_KINDS,
            logprobs=True,
            prompt_logprobs=True,
            embeddings=True,
            logit_bias=True,
        )
        llama = LlamaCppEngine(
            path,
            context_length=card.context_length,
            threads=options.threads,
            parallel=options.parallel,
            mmproj=options.mmproj,
            image_tokens=card.image_tokens,
        )
        return TokenModel(card, llama), llama
    if output == "mistralrs":
        return build_mistralrs_model(options)
    if output == "vllm":
        return build_vllm_model(options)
    if output in ("sglang", "trtllm"):
        return build_gpu_model(options)
    if output == "mocker":
        return build_mocker_model(options)
    if (python_engine := python_engine_file(output)) is not None:
        return build_python_model(options, *python_engine)
    raise ConfigError(
        f"unknown engine out={output!r}; choose one of {', '.join(ENGINES)}, pystr:FILE.py or pytok:FILE.py"
    )


def build_mocker_model(options: RunOptions, *, config: "MockerConfig | None" = None) -> tuple[ServedModel, Engine]:
    """``out=mocker``: a simulated vLLM with the model's tokenizer; its card names the mocker's KV block size.

    ``config``: settings already read (``flotilla profile`` sets its own speed-up); None reads
    ``--extra-engine-args``.
    """
    from engines.mocker.config import load_mocker_config
    from engines.mocker.engine import MockerEngine

    # The settings first: their mistakes are quicker to find than a model download.
    if config is None:
        config = load_mocker_config(options.extra_engine_args)
    card, _ = load_card(options)
    card = card.replace(kv_cache_block_size=config.block_size)
    mocker = MockerEngine(config, vocab_size=card.tokenizer.get_vocab_size())
    return TokenModel(card, mocker), mocker


def build_mistralrs_model(options: RunOptions) -> tuple[ServedModel, Engine]:
    """``out=mistralrs``: a text engine (engines/mistralrs.py says why) on a GGUF file or a safetensors folder."""
    from engines.mistralrs import MISSING_PACKAGE, MistralRsEngine, parse_settings

    # Looked up, not imported (the engine imports it when it starts): one line, not a traceback.
    if importlib.util.find_spec("mistralrs") is None:
        raise ConfigError(MISSING_PACKAGE)
    # The settings first: their mistakes are quicker to find than a model download.
    settings = parse_settings(options.extra_engine_args)
    card, path = load_card(options)
    engine = MistralRsEngine(path, card, settings, threads=options.threads)
    model = TextModel(
        card.name,
        engine,
        card.context_length,
        reasoning_parser=options.reasoning_parser,
        tool_call_parser=options.tool_call_parser,
        engine_name="mistralrs",
    )
    return model, engine


def build_vllm_model(options: RunOptions) -> tuple[ServedModel, Engine]:
    """``out=vllm``: vLLM's async engine on a safetensors folder, fed token ids by Flotilla's preprocessor."""
    from engines.vllm.engine import GUIDED_KINDS as VLLM_GUIDED_KINDS
    from engines.vllm.engine import VllmEngine
    from engines.vllm.settings import (
        MISSING_PACKAGE,
        VllmSettings,
        check_disagg_role,
        check_extra_args,
        engine_arg_names,
        read_extra_args,
    )
    from engines.vllm.vision import vision_fields

    # Looked up, not imported (importing vLLM takes seconds): one line, not a traceback.
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(MISSING_PACKAGE)
    # The settings first: their mistakes are quicker to find than a model download.
    extra = read_extra_args(options.extra_engine_args)
    check_extra_args(extra, engine_arg_names())
    check_disagg_role(options.disagg_role, extra)
    # The GPUs must split evenly over the nodes (--num-nodes): said now, before a download.
    options.node_group.local_share(options.tensor_parallel_size * int(extra.get("pipeline_parallel_size", 1)))
    card, path = load_card(options)
    if not path.is_dir():
        raise ConfigError(f"out=vllm loads a Hugging Face folder (safetensors); {str(path)!r} is not one")
    settings = VllmSettings(
        model=str(path),
        max_model_len=card.context_length,
        tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        nodes=options.node_group,
        extra=extra,
        lora=options.serves_adapters,
    )
    # Log probabilities come with vLLM's outputs, logit_bias and guided decoding (structured outputs, which also
    # follow response_format's JSON schema) are among its SamplingParams; its KV block size goes on the card for
    # KV routers (the engine refuses another one).
    block_size = extra.get("block_size") or card.kv_cache_block_size
    # A vision model (its config's vision tower and image token) takes images, which vLLM is given with the prompt.
    card = card.replace(
        logprobs=True,
        prompt_logprobs=True,
        logit_bias=True,
        structured_output=True,
        guided_decoding=VLLM_GUIDED_KINDS,
        kv_cache_block_size=block_size,
        **vision_fields(path),
    )
    engine = VllmEngine(settings, base_gpu_id=options.base_gpu_id, card_block_size=card.kv_cache_block_size)
    return TokenModel(card, engine), engine


def build_gpu_model(options: RunOptions) -> tuple[ServedModel, Engine]:
    """``out=sglang`` / ``out=trtllm``: SGLang's Engine or TensorRT-LLM's LLM on a safetensors folder, fed token
    ids by Flotilla's preprocessor, placed on the GPUs and memory share the flags give."""
    from engines.sglang import engine as sglang
    from engines.shared.gpu_engine_args import GpuPlacement
    from engines.shared.grammar_constraints import GUIDED_KINDS
    from engines.trtllm import engine as trtllm

    output = options.output
    module = sglang if output == "sglang" else trtllm
    # Looked up, not imported (importing either takes seconds and CUDA): one line, not a traceback.
    if importlib.util.find_spec("sglang" if output == "sglang" else "tensorrt_llm") is None:
        raise ConfigError(module.MISSING_PACKAGE)
    # The arguments first: their mistakes are quicker to find than a model download.
    extra = module.parse_engine_args(options.extra_engine_args)
    placement = GpuPlacement(
        tensor_parallel_size=options.tensor_parallel_size,
        base_gpu_id=options.base_gpu_id or 0,
        context_length=options.context_length,
        gpu_memory_fraction=options.gpu_memory_utilization,
    )
    if output == "sglang":  # the GPUs must split evenly over the nodes: said now, before a download
        options.node_group.local_share(options.tensor_parallel_size * int(extra.get("pp_size", 1)))
    card, path = load_card(options)
    if not path.is_dir():
        raise ConfigError(f"out={output} loads a Hugging Face folder (safetensors); {str(path)!r} is not one")
    engine: sglang.SglangEngine | trtllm.TrtLlmEngine
    if output == "sglang":
        engine = sglang.SglangEngine(
            path, placement, extra, options.node_group, role=options.disagg_role, lora=options.serves_adapters
        )
        card = card.replace(logprobs=True)  # SGLang reports the output's log probabilities
    else:
        engine = trtllm.TrtLlmEngine(path, placement, extra, role=options.disagg_role, lora=options.serves_adapters)
    # Both follow JSON schemas, regexes, choices and grammars by their grammar backends
    # (engines/shared/grammar_constraints.py).
    card = card.replace(structured_output=True, guided_decoding=GUIDED_KINDS)
    # The engine's KV block size goes on the card, so that KV routers name blocks as its events do.
    card = card.replace(kv_cache_block_size=engine.block_size)
    return TokenModel(card, engine), engine


def settled_card(card: ModelCard, engine: Engine) -> ModelCard:
    """``card`` with the KV block size ``engine`` settled on once started (SGLang rewrites its page size for some
    attention backends), so that KV routers name blocks as its events do."""
    settled = getattr(engine, "block_size", None)
    if not isinstance(settled, int) or settled == card.kv_cache_block_size:
        return card
    return card.replace(kv_cache_block_size=settled)


def build_python_model(options: RunOptions, kind: str, file: str) -> tuple[ServedModel, Engine]:
    """``out=pystr:FILE.py`` / ``out=pytok:FILE.py``: the user's ``generate`` behind a text or token model."""
    if not file:
        raise ConfigError(f"out={kind}: needs a file: out={kind}:FILE.py")
    path = Path(file)
    # The file first: its mistakes are quicker to find than a model download.
    generate = load_generate(path)
    if kind == "pystr":
        text = PyStrEngine(generate, path.name)
        return text_model(options.model_name or path.stem, text, options), text
    card, _ = load_card(options)
    token = PyTokEngine(generate, path.name)
    return TokenModel(card, token), token


async def run(options: RunOptions) -> int:
    """Run until the input is done (text, batch) or until a signal (http, dyn). Returns the exit code."""
    if options.output == "dyn":
        return await run_ingress(options)
    model, engine = build_model(options)
    await engine.start()
    if isinstance(model, TokenModel):
        model.card = settled_card(model.card, engine)
    heap.settle()  # the model, the tokenizer and the engine are loaded: see launcher/heap.py
    try:
        if (address := options.worker_address) is not None:
            from launcher.inputs.dyn import serve_worker

            card = model.card if isinstance(model, TokenModel) else text_card(model, options)
            await serve_worker(
                EndpointAddress.parse(address),
                engine,
                card,
                labels=options.labels,
                router=options.worker_router,
                role=options.disagg_role,
                metrics_host=options.http_host,
                metrics_port=options.metrics_port,
                loras=options.loras,
                lora_file=options.lora_file,
            )
            return 0
        if options.input == "http":
            from launcher.inputs.http import serve_http

            registry = ModelRegistry()
            registry.add(model)
            watching = None
            if options.loras or options.lora_file is not None:
                from launcher.local_adapters import serve_local_adapters

                watching = await serve_local_adapters(registry, model, engine, options.loras, options.lora_file)
            try:
                stopped_by = await serve_http(registry, options)
            finally:
                if watching is not None:
                    watching.cancel()
            return exit_code_after(stopped_by)
        if options.input == "text":
            from launcher.inputs.text import run_text

            return await run_text(model, max_tokens=options.max_tokens, temperature=options.temperature)
        if (batch_file := options.batch_file) is not None:
            from launcher.inputs.batch import run_batch

            summary = await run_batch(
                model,
                batch_file,
                concurrency=options.batch_concurrency,
                max_tokens=options.max_tokens,
                temperature=options.temperature,
                progress=True,
            )
            return 0 if summary.ok or not summary.skipped else 1
        raise ConfigError(f"unknown input in={options.input!r}; use in=text, in=http or in=batch:FILE.jsonl")
    finally:
        await engine.close()


def text_model(name: str, engine: TextEngine, options: RunOptions) -> TextModel:
    return TextModel(
        name,
        engine,
        options.context_length,
        reasoning_parser=options.reasoning_parser,
        tool_call_parser=options.tool_call_parser,
        engine_name=options.output,
    )


def text_card(model: ServedModel, options: RunOptions) -> ModelCard:
    """The card a text engine registers: a name, a type and its parsers, no tokenizer."""
    return ModelCard(
        name=model.name,
        model_type=ModelType.CHAT,
        context_length=model.context_length or options.context_length or 0,
        reasoning_parser=options.reasoning_parser,
        tool_call_parser=options.tool_call_parser,
        engine=options.output,
    )


async def run_ingress(options: RunOptions) -> int:
    """``out=dyn``: serve over HTTP every model that workers register in etcd.

    Returns 0 after SIGINT/SIGTERM, 1 when a background task the ingress needs failed (logged).
    """
    from frontend_gateway.control_plane_proxy import ControlPlaneProxy
    from frontend_gateway.metrics import GatewayMetrics
    from frontend_gateway.models.pipeline import ServingStatus
    from frontend_gateway.models.served_names import ServedNames
    from frontend_gateway.models.watcher import ModelWatcher
    from frontend_gateway.routing.protocol import RouterMode, RouterSettings
    from launcher.inputs.http import serve_http
    from launcher.startup import connect_runtime

    if options.input != "http":
        raise ConfigError("out=dyn is the ingress of a distributed deployment: use it with in=http")
    runtime = await connect_runtime()
    if runtime is None:
        return 0  # stopped by SIGTERM before etcd and NATS answered
    runtime.progress_deadline = options.progress_deadline_s
    registry = ModelRegistry()
    metrics = GatewayMetrics()
    watcher = ModelWatcher(
        runtime,
        registry,
        router=RouterSettings(
            mode=RouterMode(options.router_mode),
            overlap_score_weight=options.kv_overlap_score_weight,
            queued_prefill_weight=options.kv_queued_prefill_weight,
            temperature=options.router_temperature,
            use_kv_events=options.use_kv_events,
            host_hit_weight=options.kv_host_hit_weight,
            disk_hit_weight=options.kv_disk_hit_weight,
            predicted_ttl_s=options.router_ttl_s,
            busy_kv_usage=options.busy_kv_usage,
            busy_waiting=options.busy_waiting,
            replica_sync=options.router_replica_sync,
            disagg=options.disagg_policy,
        ),
        migration_limit=options.migration_limit,
        metrics=metrics,
    )
    # Restarted if it fails: it resumes from what it had applied, so model changes are never missed.
    runtime.own(watcher.run, name="model watcher", restart=True)
    registry.arrival = watcher.arrival
    registry.status = lambda: ServingStatus(
        nats=bool(runtime.nc.is_connected), etcd=runtime.discovery.connected, instances=watcher.instance_counts()
    )
    try:
        api_keys = await _api_keys(runtime, options.api_keys_secret_file, metrics)
        meter = _meter(runtime, options.quota_redis_url) if api_keys is not None else None
        served_names = ServedNames()  # its watch lists them first: no request waits on it
        runtime.own(lambda: served_names.run(runtime.discovery), name="served-name watcher", restart=True)
    except BaseException:
        await watcher.close()
        await runtime.close()
        raise
    control_plane = ControlPlaneProxy(options.control_plane_url) if options.control_plane_url else None
    # A runtime shut down by a failed task stops the HTTP server too, and the process exits non-zero.
    stop = asyncio.Event()
    stop_on_failure = asyncio.create_task(_set_when_shut_down(runtime, stop))
    heap.settle()  # connected and imported: see launcher/heap.py
    try:
        stopped_by = await serve_http(
            registry,
            options,
            metrics=metrics,
            stop=stop,
            api_keys=api_keys,
            meter=meter,
            served_names=served_names,
            max_concurrent_per_key=options.max_concurrent_per_key,
            control_plane=control_plane,
        )
    finally:
        stop_on_failure.cancel()
        if control_plane is not None:
            await control_plane.aclose()
        await watcher.close()
        if meter is not None:
            await meter.close()  # the counts of the last moments go to Redis: a clean stop loses none
        await runtime.close()
        log.info("the ingress closed its etcd and NATS connections")
    if runtime.failure is not None:
        log.error("the ingress stopped because %s", runtime.failure)
        return 1
    return exit_code_after(stopped_by)


async def _api_keys(
    runtime: "DistributedRuntime", secret_file: Path | None, metrics: "GatewayMetrics"
) -> "KeyTable | None":
    """The ingress's API keys, loaded from etcd and then watched; None when keys are not required (said
    in a warning: /v1/* is then open to whoever reaches the port).

    Raises ConfigError for an unreadable secret, DiscoveryUnavailable when etcd cannot list the keys.
    """
    from frontend_gateway.access.api_keys import KeyTable
    from frontend_gateway.access.secret_file import follow_secret_file
    from runtime.fleet_contract.api_keys import read_secrets

    if secret_file is None:
        log.warning(OPEN_INGRESS_WARNING)
        return None
    table = KeyTable(read_secrets(secret_file), on_skipped=metrics.api_key_record_skipped)
    await table.load(runtime.discovery)
    # Restarted if it fails: the watch resumes from the records it has applied.
    runtime.own(lambda: table.run(runtime.discovery), name="API key watcher", restart=True)
    # A rotation of the secret needs no restart: the file is read again while the ingress runs.
    runtime.own(lambda: follow_secret_file(secret_file, table), name="API key secret reader", restart=True)
    log.info("API keys required on /v1/*: %d key(s) from the control plane", len(table))
    return table


def _meter(runtime: "DistributedRuntime", redis_url: str | None) -> "Meter":
    """The keys' limits and usage, shared through ``redis_url`` (None: this process counts alone).

    Raises ConfigError for a malformed URL.
    """
    from frontend_gateway.access.quotas import Meter

    if redis_url is None:
        log.warning(
            "API keys: no --quota-redis, so each ingress process enforces keys' limits alone and no usage is recorded"
        )
        return Meter(None)
    import redis.asyncio as aioredis

    try:
        client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=1.0)
    except ValueError as exc:
        raise ConfigError(f"--quota-redis (FLOTILLA_QUOTA_REDIS_URL): {exc}") from exc
    meter = Meter(client)
    runtime.own(meter.run, name="API key meter", restart=True)
    return meter


def exit_code_after(signum: int | None) -> int:
    """0 after SIGTERM (a supervisor's stop) or the end of the input; 130 after Ctrl-C, as a shell expects."""
    return 130 if signum == signal.SIGINT else 0


async def _set_when_shut_down(runtime: "DistributedRuntime", stop: asyncio.Event) -> None:
    await runtime.wait_for_shutdown()
    stop.set()
