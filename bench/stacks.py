"""Whole serving stacks for side-by-side benchmarks: Flotilla's, and NVIDIA Dynamo 1.6.1's as the reference.

Each context manager starts a stack on free loopback ports (logs in a folder of its own), waits until
its ingress routes to every worker, yields a ``Stack`` and stops every process on exit. A start-up
that fails raises RuntimeError with the tail of every log.

* ``flotilla_stack``: etcd + NATS (``network_path.infrastructure``), N ``flotilla run in=dyn://MODEL
  out=mocker`` workers and ``flotilla run in=http out=dyn --router-mode …``. Ready once the ingress
  lists the model and each worker has answered a probe (the ``x-flotilla-instance`` header names it).
  ``worker_stack`` is the same with workers of any engine (``StackWorker``).
* ``dynamo_stack``: NATS, ``python -m dynamo.mocker --num-workers N`` and ``python -m dynamo.frontend
  --router-mode …`` with the file discovery backend, the TCP request plane and the NATS event plane
  (/work/shared/ENVIRONMENT.md). Ready once the frontend lists the model and N ``generate`` instances
  in its /health. Its mocker reads a Hugging Face folder, built here from SmolLM2's GGUF by our own
  loader, so both stacks tokenize with the same tokenizer.

Both mockers get the same settings (the keys of ``--extra-engine-args``, Dynamo's names), mapped to
Dynamo's flags by ``dynamo_mocker_flags``.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import ServerProcess, free_port, running_server
from network_path import flotilla, infrastructure
from overload import smollm2_path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.mocker.config import parse_mocker_config  # noqa: E402
from runtime.errors import ConfigError  # noqa: E402
from runtime.models.loading import load_model_card  # noqa: E402
from runtime.models.tokenizer import gguf_metadata, open_gguf  # noqa: E402

MODEL = "smol"
#: Dynamo's interpreter: `make dynamo` installs it in .dynamo-venv/ (DYNAMO_PYTHON points elsewhere).
DYNAMO_PYTHON = Path(os.environ.get("DYNAMO_PYTHON", ROOT / ".dynamo-venv" / "bin" / "python"))
ROUTER_MODES = ("kv", "round-robin", "random")
#: The stacks a side-by-side benchmark compares, in the order they run (its ``--stacks`` picks some).
STACK_NAMES = ("flotilla", "dynamo")
#: Ask Dynamo's frontend to name the worker in every streamed chunk (``nvext.worker_id``).
DYNAMO_WORKER_FIELDS: dict[str, Any] = {"nvext": {"extra_fields": ["worker_id"]}}
_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Stack:
    """A running stack: where to send requests, and what to read about it."""

    name: str  # "flotilla" or "dynamo"
    base_url: str
    port: int
    model: str
    block_size: int
    #: Worker ids as responses name them (Flotilla: hex instance ids; Dynamo: decimal worker ids).
    worker_ids: tuple[str, ...]
    #: The ingress process(es), whose CPU time a benchmark may read.
    ingress_pids: tuple[int, ...]
    worker_pids: tuple[int, ...]
    log_dir: Path
    #: Fields to add to a request body so that its answer names the worker that served it.
    worker_fields: Mapping[str, Any] = field(default_factory=dict)
    #: Every ingress's port when there are several (``port`` is the first's); a client spreads over them.
    ports: tuple[int, ...] = ()


def check_mocker_settings(settings: Mapping[str, Any], *, dynamo: bool = False) -> dict[str, Any]:
    """``settings`` as a plain dict once our parser (and, with ``dynamo``, the mapping to Dynamo) accepts them.

    Raises ValueError naming the bad key.
    """
    try:
        parse_mocker_config(dict(settings), "mocker settings")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if dynamo:
        dynamo_mocker_flags(settings)
    return dict(settings)


def stack_names(text: str) -> list[str]:
    """An argparse type: comma-separated names from STACK_NAMES (``flotilla`` alone: where Dynamo is not
    installed), in STACK_NAMES's order."""
    names = [name for name in text.split(",") if name]
    if unknown := [name for name in names if name not in STACK_NAMES]:
        raise argparse.ArgumentTypeError(f"unknown stack {unknown[0]!r} (choose from {', '.join(STACK_NAMES)})")
    if not names:
        raise argparse.ArgumentTypeError("name at least one stack")
    return [name for name in STACK_NAMES if name in names]


def _spawn(command: Sequence[str], log_path: Path, env: Mapping[str, str]) -> ServerProcess:
    """Start ``command`` in a session of its own (so its whole group can be stopped), logging to ``log_path``."""
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            list(command),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            cwd=ROOT,
            start_new_session=True,
        )
    return ServerProcess(process, "", log_path)


def _logs(directory: Path) -> str:
    """The tail of every log in ``directory``: etcd's and NATS's first and shortest, the stack's own last."""
    servers = ("etcd.log", "nats.log")
    paths = sorted(directory.glob("*.log"), key=lambda path: (path.name not in servers, path.name))
    return "\n".join(
        f"--- {path.name}\n"
        + "\n".join(path.read_text(errors="replace").splitlines()[-(5 if path.name in servers else 25) :])
        for path in paths
    )


def _wait(
    condition: Any, processes: Sequence[ServerProcess], directory: Path, what: str, timeout_s: float = _READY_TIMEOUT_S
) -> None:
    """Poll ``condition()`` until true; RuntimeError with every log's tail if a process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.TransportError):
            if condition():
                return
        exited = [p.log_path.stem for p in processes if p.process.poll() is not None]
        if exited or time.monotonic() > deadline:
            reason = f"{', '.join(exited)} exited" if exited else f"not ready after {timeout_s:.0f}s"
            raise RuntimeError(f"{what}: {reason}\n{_logs(directory)}")
        time.sleep(0.1)  # polling other processes: there is no event to await


def _start_http(
    stack: contextlib.ExitStack, command: Sequence[str], port: int, log_path: Path, env: Mapping[str, str]
) -> ServerProcess:
    """Start an HTTP ingress on ``stack`` and wait for its /live; RuntimeError with every log's tail if not."""
    try:
        return stack.enter_context(
            running_server(
                command, port=port, ready_path="/live", log_path=log_path, env=env, cwd=ROOT, timeout=_READY_TIMEOUT_S
            )
        )
    except RuntimeError as exc:
        raise RuntimeError(f"{log_path.stem}: {str(exc).splitlines()[0]}\n{_logs(log_path.parent)}") from None


def _models(base_url: str) -> list[str]:
    reply = httpx.get(base_url + "/v1/models", timeout=2)
    return [model["id"] for model in reply.json().get("data", [])] if reply.status_code == 200 else []


@contextlib.contextmanager
def _log_dir(log_dir: Path | None) -> Iterator[Path]:
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        yield log_dir
    else:
        with tempfile.TemporaryDirectory(prefix="stack-") as temp:
            yield Path(temp)


@dataclass(frozen=True)
class StackWorker:
    """One worker of ``worker_stack``: its disaggregation role ("" for an aggregated worker), its ``flotilla run``
    arguments after its input (the engine, the model and their flags), and environment variables of its own."""

    role: str
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def flotilla_stack(
    *,
    workers: int = 4,
    mocker_settings: Mapping[str, Any],
    router_mode: str = "kv",
    use_kv_events: bool = True,
    overlap_weight: float = 1.0,
    model: str = MODEL,
    ingress_args: Sequence[str] = (),
    log_dir: Path | None = None,
    ingresses: int = 1,
    disagg: tuple[int, int] | None = None,
) -> Iterator[Stack]:
    """Flotilla: etcd, NATS, ``workers`` mocker workers and ``ingresses`` ingress processes (each on a port
    of its own, as replicas behind a load balancer); yields the running Stack.

    ``disagg`` (prefill workers, decode workers) replaces ``workers`` with that many workers of each role
    (``--disagg-role``, on the model's ``prefill`` and ``decode`` components); ``worker_ids`` lists the
    decode workers first.

    ``overlap_weight`` is ``--kv-overlap-score-weight``: kv routing weighs a block of prefill saved by
    a cache hit this much against a block of decode load.

    Raises ValueError for an unknown router mode or mocker setting, RuntimeError if it does not come up.
    """
    settings = check_mocker_settings(mocker_settings)
    with _log_dir(log_dir) as directory:
        settings_path = directory / "mocker.json"
        settings_path.write_text(json.dumps(settings))
        roles = [("decode", disagg[1]), ("prefill", disagg[0])] if disagg else [("", workers)]
        mockers = [
            StackWorker(role, ("out=mocker", str(smollm2_path()), "--extra-engine-args", str(settings_path)))
            for role, count in roles
            for _ in range(count)
        ]
        with worker_stack(
            mockers,
            directory=directory,
            model=model,
            router_mode=router_mode,
            use_kv_events=use_kv_events,
            overlap_weight=overlap_weight,
            ingress_args=ingress_args,
            ingresses=ingresses,
            block_size=int(settings.get("block_size", 64)),
        ) as stack:
            yield stack


@contextlib.contextmanager
def worker_stack(
    workers: Sequence[StackWorker],
    *,
    directory: Path,
    model: str = MODEL,
    router_mode: str = "kv",
    use_kv_events: bool = True,
    overlap_weight: float = 1.0,
    ingress_args: Sequence[str] = (),
    ingresses: int = 1,
    block_size: int = 64,
    ready_timeout_s: float = _READY_TIMEOUT_S,
) -> Iterator[Stack]:
    """etcd, NATS, ``workers`` (any engine: each ``flotilla run in=dyn://MODEL[.ROLE.generate] ARGS --model-name
    MODEL``, logging to ``directory``) and ``ingresses`` ingress processes; yields the Stack once every worker
    has answered through the ingress (``ready_timeout_s`` for each wait: a GPU engine's start takes minutes).

    Raises ValueError for an unknown router mode, RuntimeError if it does not come up.
    """
    if router_mode not in ROUTER_MODES:
        raise ValueError(f"router_mode {router_mode!r} is not one of {', '.join(ROUTER_MODES)}")
    directory.mkdir(parents=True, exist_ok=True)
    with infrastructure(directory) as servers, contextlib.ExitStack() as stack:
        env = {**servers, "FLOTILLA_LOG": "warning"}
        processes: list[ServerProcess] = []
        numbers: dict[str, int] = {}
        for worker in workers:
            role = worker.role
            where = [f"in=dyn://{model}.{role}.generate", "--disagg-role", role] if role else [f"in=dyn://{model}"]
            number = numbers[role] = numbers.get(role, -1) + 1
            command = flotilla(where[0], *worker.args, "--model-name", model, *where[1:])
            log_path = directory / f"worker-{role or 'agg'}-{number}.log"
            processes.append(_spawn(command, log_path, {**env, **worker.env}))
            stack.callback(processes[-1].stop)
        fronts: list[ServerProcess] = []
        ports = [free_port() for _ in range(ingresses)]
        for number, port in enumerate(ports):
            fronts.append(
                _start_http(
                    stack,
                    flotilla(
                        "in=http", "out=dyn", "--http-port", str(port), "--router-mode", router_mode,
                        "--use-kv-events", "true" if use_kv_events else "false",
                        "--kv-overlap-score-weight", str(overlap_weight), *ingress_args,
                    ),
                    port, directory / ("ingress.log" if ingresses == 1 else f"ingress-{number}.log"), env,
                )
            )  # fmt: skip
        instance_ids = _worker_banners(processes, directory, ready_timeout_s)
        for ingress in fronts:
            _wait_routed(ingress, model, instance_ids, processes, directory, ready_timeout_s)
        yield Stack(
            name="flotilla",
            base_url=fronts[0].base_url,
            port=ports[0],
            model=model,
            block_size=block_size,
            worker_ids=tuple(instance_ids),
            ingress_pids=tuple(ingress.process.pid for ingress in fronts),
            worker_pids=tuple(p.process.pid for p in processes),
            log_dir=directory,
            ports=tuple(ports),
        )


def _wait_routed(
    ingress: ServerProcess,
    model: str,
    instance_ids: Sequence[str],
    workers: list[ServerProcess],
    directory: Path,
    timeout_s: float = _READY_TIMEOUT_S,
) -> None:
    """Wait until ``ingress`` lists ``model`` and has routed a probe to each of ``instance_ids``."""
    everyone = [*workers, ingress]
    _wait(lambda: model in _models(ingress.base_url), everyone, directory, "flotilla: model", timeout_s)
    answered: set[str] = set()

    def every_worker_answered() -> bool:
        # 4 tokens: less than a KV block, so the probes leave nothing cached for the benchmark to hit.
        body = {"model": model, "prompt": [1000, 1001, 1002, 1003], "max_tokens": 1}
        reply = httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=10)
        if reply.status_code == 200:
            answered.add(reply.headers["x-flotilla-instance"])
            if prefill := reply.headers.get("x-flotilla-prefill-instance"):
                answered.add(prefill)
        return answered >= set(instance_ids)

    _wait(every_worker_answered, everyone, directory, "flotilla: a worker never answered", timeout_s)


def _worker_banners(processes: list[ServerProcess], directory: Path, timeout_s: float = _READY_TIMEOUT_S) -> list[str]:
    """Each worker's instance id (hex), from the banner it prints once registered."""
    ids: dict[int, str] = {}

    def every_banner() -> bool:
        for number, process in enumerate(processes):
            for line in process.log_path.read_text(errors="replace").splitlines():
                if line.startswith("Flotilla worker "):
                    ids[number] = line.split()[2]
        return len(ids) == len(processes)

    _wait(every_banner, processes, directory, "flotilla: a worker never registered", timeout_s)
    return [ids[number] for number in range(len(processes))]


# Our mocker's keys -> Dynamo 1.6.1's `python -m dynamo.mocker` flags (`--help` there). Booleans are
# a flag and its --no- form.
_DYNAMO_FLAGS = {
    "num_gpu_blocks": "--num-gpu-blocks-override",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "enable_prefix_caching": "--enable-prefix-caching",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "speedup_ratio": "--speedup-ratio",
    "decode_speedup_ratio": "--decode-speedup-ratio",
    "dp_size": "--data-parallel-size",
    "startup_time": "--startup-time",
    "preemption_mode": "--preemption-mode",
    "kv_transfer_bandwidth": "--kv-transfer-bandwidth",
    "kv_bytes_per_token": "--kv-bytes-per-token",
    "num_host_blocks": "--num-host-blocks",
    "host_offload_d2h_bandwidth_gbps": "--host-offload-d2h-bandwidth-gbps",
    "host_offload_h2d_bandwidth_gbps": "--host-offload-h2d-bandwidth-gbps",
}
#: Keys Dynamo 1.6.1's mocker has no setting for, with the only value both stacks then agree on: its
#: engine (aisimulate-core 0.13.0) admits as vLLM v1 does, with no watermark.
_DYNAMO_FIXED = {"watermark": 0.0}
#: Keys of ours only, given to Dynamo's mocker as nothing: it has one scheduler of its own (vLLM v1's,
#: with no watermark), whichever of vLLM's ours simulates.
_DYNAMO_IGNORED = ("scheduler",)


def dynamo_mocker_flags(settings: Mapping[str, Any]) -> list[str]:
    """Dynamo mocker flags that configure it as ``settings`` (our keys) configure ours.

    Raises ValueError for a bad setting, or one Dynamo 1.6.1 cannot be given (``watermark`` other than
    0, a speed-up of 0).
    """
    flags: list[str] = []
    for key in ("speedup_ratio", "decode_speedup_ratio"):
        if settings.get(key) == 0:
            # Its --help says 0 means no waiting, but 1.6.1 then waits in real time (measured: a 4000-token
            # prompt and 30 tokens took ~300 ms at 0, ~50 ms at 1e6).
            raise ValueError(f"Dynamo 1.6.1's mocker does not honour {key} 0: give a large ratio, e.g. 1e6")
    for key, value in check_mocker_settings(settings).items():
        if key in _DYNAMO_IGNORED:
            continue
        if key in _DYNAMO_FIXED:
            if value != _DYNAMO_FIXED[key]:
                raise ValueError(f"Dynamo's mocker has no {key} setting: only {_DYNAMO_FIXED[key]} compares")
            continue
        flag = _DYNAMO_FLAGS[key]
        if isinstance(value, bool):
            flags.append(flag if value else flag.replace("--", "--no-", 1))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def build_model_folder(gguf: Path, folder: Path) -> Path:
    """A Hugging Face folder (config.json, tokenizer.json, tokenizer_config.json, no weights) from a GGUF.

    The tokenizer, chat template, special tokens and context length come from our own loader, so a
    stack fed from the folder tokenizes exactly as one fed from the GGUF. Returns ``folder``.
    """
    card = load_model_card(gguf)
    reader = open_gguf(gguf)
    meta = gguf_metadata(reader)
    arch = meta.architecture

    def value(key: str) -> Any:
        return reader.values.get(f"{arch}.{key}")

    folder.mkdir(parents=True, exist_ok=True)
    assert card.tokenizer_json is not None  # a GGUF's card always carries its tokenizer
    (folder / "tokenizer.json").write_text(card.tokenizer_json)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": card.chat_template,
                "bos_token": card.bos_token,
                "eos_token": card.eos_token,
                "model_max_length": card.context_length,
            }
        )
    )
    heads = value("attention.head_count")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"] if arch == "llama" else [],
                "model_type": arch,
                "max_position_embeddings": card.context_length,
                "bos_token_id": meta.bos_token_id,
                "eos_token_id": card.eos_token_ids[0] if len(card.eos_token_ids) == 1 else card.eos_token_ids,
                "vocab_size": card.tokenizer.get_vocab_size(),
                # The shape only sizes a KV token in bytes (disaggregation); the mocker loads no weights.
                "hidden_size": value("embedding_length"),
                "num_hidden_layers": value("block_count"),
                "num_attention_heads": heads,
                "num_key_value_heads": value("attention.head_count_kv") or heads,
                "intermediate_size": value("feed_forward_length"),
                "torch_dtype": "bfloat16",
            }
        )
    )
    return folder


def _dynamo_instances(base_url: str) -> list[str]:
    """The ids of the ``generate`` instances Dynamo's frontend knows, from its /health."""
    reply = httpx.get(base_url + "/health", timeout=2)
    instances = reply.json().get("instances", []) if reply.status_code == 200 else []
    return sorted({str(i["instance_id"]) for i in instances if i.get("endpoint") == "generate"})


@contextlib.contextmanager
def dynamo_stack(
    *,
    workers: int = 4,
    mocker_settings: Mapping[str, Any],
    router_mode: str = "kv",
    use_kv_events: bool = True,
    overlap_weight: float = 1.0,
    model: str = MODEL,
    frontend_args: Sequence[str] = (),
    frontends: int = 1,
    replica_sync: bool = True,
    python: Path = DYNAMO_PYTHON,
    log_dir: Path | None = None,
    disagg: tuple[int, int] | None = None,
) -> Iterator[Stack]:
    """NVIDIA Dynamo: NATS, one ``dynamo.mocker`` process with ``workers`` workers, and ``frontends``
    frontends, each on its own port (with kv routing and more than one, ``--router-replica-sync`` as
    ``replica_sync`` says: Dynamo's own, the counterpart of Flotilla's).

    ``disagg`` (prefill workers, decode workers) replaces ``workers`` with two mocker processes,
    ``--disaggregation-mode prefill`` and ``decode`` with that many workers each; the frontend pairs them
    by itself (``frontend_args`` may add ``--router-conditional-disagg``).

    ``overlap_weight`` is ``--router-prefill-load-scale``: Dynamo's cost is that scale × (prompt blocks −
    credit × cached blocks, at least 0) + decode blocks; with the credit left at 1 that is our
    weight × blocks left to prefill + decode blocks. (Raising the credit instead would not compare: the
    clamp at 0 makes every worker with a long enough hit cost the same.)

    Raises ValueError for an unknown router mode or a setting Dynamo cannot take, RuntimeError if
    Dynamo is not installed at ``python`` or the stack does not come up.
    """
    if router_mode not in ROUTER_MODES:
        raise ValueError(f"router_mode {router_mode!r} is not one of {', '.join(ROUTER_MODES)}")
    mocker_flags = dynamo_mocker_flags(mocker_settings)
    if not python.exists():
        raise RuntimeError(f"no Dynamo at {python}: run `make dynamo`, or set DYNAMO_PYTHON")
    with _log_dir(log_dir) as directory, infrastructure(directory) as servers, contextlib.ExitStack() as stack:
        model_dir = build_model_folder(smollm2_path(), directory / "model")
        env = {
            # Only NATS: Dynamo discovers through files here, and the etcd that infrastructure() starts idles.
            "NATS_SERVER": servers["NATS_SERVER"],
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(directory / "dynamo-discovery"),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "nats",
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            # As FLOTILLA_LOG=warning: Dynamo logs requests at info, which costs CPU under load (its
            # frontend still writes one "route request completed" line per request).
            "DYN_LOG": "warn",
        }
        mockers = []
        for mode, count in [("prefill", disagg[0]), ("decode", disagg[1])] if disagg else [("", workers)]:
            mode_flags = ["--disaggregation-mode", mode] if mode else []
            mockers.append(
                _spawn(
                    [str(python), "-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name", model,
                     "--num-workers", str(count), *mode_flags, *mocker_flags],
                    directory / f"mocker{'-' + mode if mode else ''}.log", env,
                )
            )  # fmt: skip
            stack.callback(mockers[-1].stop)
        workers = sum(disagg) if disagg else workers
        frontend_flags = ["--router-mode", router_mode]
        if router_mode == "kv":
            frontend_flags += ["--router-prefill-load-scale", str(overlap_weight)]
            if not use_kv_events:
                frontend_flags.append("--no-router-kv-events")
            if frontends > 1:
                frontend_flags.append("--router-replica-sync" if replica_sync else "--no-router-replica-sync")
        ports = [free_port() for _ in range(frontends)]
        fronts = []
        for number, port in enumerate(ports):
            command = [
                str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                *frontend_flags, *frontend_args,
            ]  # fmt: skip
            log_path = directory / f"frontend{'' if number == 0 else number}.log"
            fronts.append(_start_http(stack, command, port, log_path, env))
        frontend = fronts[0]
        _wait(
            lambda: all(
                model in _models(front.base_url) and len(_dynamo_instances(front.base_url)) == workers
                for front in fronts
            ),
            [*mockers, *fronts],
            directory,
            "dynamo: the model or a worker never appeared",
        )
        yield Stack(
            name="dynamo",
            base_url=frontend.base_url,
            port=ports[0],
            model=model,
            block_size=int(mocker_settings.get("block_size", 64)),
            worker_ids=tuple(_dynamo_instances(frontend.base_url)),
            ingress_pids=tuple(front.process.pid for front in fronts),
            worker_pids=tuple(mocker.process.pid for mocker in mockers),
            log_dir=directory,
            worker_fields=DYNAMO_WORKER_FIELDS,
            ports=tuple(ports),
        )
