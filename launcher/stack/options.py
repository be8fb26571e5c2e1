"""The command line of ``flotilla up``: its flags (each with an environment variable), checked into ``UpOptions``."""

import argparse
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.inventory import parse_gpu_spec
from controlplane.secret_key import default_data_dir
from launcher.arg_types import checked_by, integer, number, tcp_port
from launcher.env_flags import EnvArgumentParser
from launcher.stack.controlplane import FirstModel
from launcher.stack.restarts import RestartPolicy
from runtime.errors import ConfigError
from runtime.fleet_contract.engine_names import GPU_ONLY_ENGINES, IMPLEMENTED_ENGINES

#: The engines a first pipeline may use: those that run on a CPU (the catalog's names).
FIRST_PIPELINE_ENGINES = tuple(name for name in IMPLEMENTED_ENGINES if name not in GPU_ONLY_ENGINES)

UP_DESCRIPTION = """\
Bring up the whole stack on this machine: etcd, NATS and Redis on loopback, the control plane (REST API,
dashboard) with a first admin account, the Celery worker and beat (the reconciler), one agent (node
"local"), the gateway (OpenAI API), and a first pipeline of the default model when there is none.
Ctrl-C stops everything. Logs, the database and tokens are kept in the data folder.
"""

UP_EPILOG = """\
examples:
  flotilla up                                   # SmolLM2 on llama.cpp, OpenAI API on :8080
  flotilla up --engine mocker                   # a simulated engine: quick, no model weights
  flotilla up --model ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf
  flotilla up --no-pipeline --gpus 2x24GiB      # a node with two simulated GPUs; deploy through the API

etcd, NATS and Redis take their usual ports (2379, 4222, 6379) when free, else free ones (say so; 0 asks for
any free port). `flotilla run` needs none of this: it serves a model in one process.
A part that ends is started again after 1, 2, 4 ... 30 s. One that ends more than --restart-burst times within
--restart-window seconds (or exits with code 2, its configuration refused) is given up on: the gateway, etcd or
NATS stops the stack; any other part is reported as an ERROR while serving goes on, and is tried again every
--retry-given-up seconds.
exit codes: 0 stopped by SIGTERM, 1 a part the gateway needs kept failing, or a part did not start (its log is
shown), 2 bad usage, 130 Ctrl-C
"""


@dataclass(frozen=True, kw_only=True)
class UpOptions:
    http_port: int = 8080
    control_plane_port: int = 8000
    etcd_port: int = 2379
    nats_port: int = 4222
    redis_port: int = 6379
    data_dir: Path
    first_model: FirstModel | None  # None: --no-pipeline
    gpus: str | None = None
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    #: The gateway needs an API key on /v1/* (the first one is made for the admin and printed once).
    api_keys: bool = True


_port = tcp_port(any_free=True)
_count = integer(0)
_seconds = number(0.0, above_minimum=True, unit="seconds")


def _gpus(text: str) -> str:
    checked_by(parse_gpu_spec)(text)
    return text


def build_up_parser() -> EnvArgumentParser:
    """The parser of ``flotilla up``; every option but ``-v`` has an environment variable."""
    up = EnvArgumentParser(
        prog="flotilla up",
        description=UP_DESCRIPTION,
        epilog=UP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_flag("--http-port", env="FLOTILLA_HTTP_PORT", type=_port, default=8080, help="the gateway's port (8080)")
    up.add_flag(
        "--control-plane-port",
        env="FLOTILLA_CONTROL_PLANE_PORT",
        type=_port,
        default=8000,
        help="the control plane's port: REST API, dashboard (8000)",
    )
    up.add_flag("--etcd-port", env="FLOTILLA_ETCD_PORT", type=_port, default=2379, help="etcd's port, if free (2379)")
    up.add_flag("--nats-port", env="FLOTILLA_NATS_PORT", type=_port, default=4222, help="NATS's port, if free (4222)")
    up.add_flag(
        "--redis-port", env="FLOTILLA_REDIS_PORT", type=_port, default=6379, help="Redis's port, if free (6379)"
    )
    up.add_flag(
        "--data-dir",
        env="FLOTILLA_DATA_DIR",
        type=Path,
        help=f"database, logs, tokens, models (default {default_data_dir()})",
    )
    up.add_flag(
        "--model",
        env="FLOTILLA_MODEL_PATH",
        type=Path,
        help="the first pipeline's model: a GGUF file or a Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    up.add_flag(
        "--engine",
        env="FLOTILLA_ENGINE",
        choices=FIRST_PIPELINE_ENGINES,
        default="llamacpp",
        help="the first pipeline's engine (llamacpp)",
    )
    up.add_flag("--no-pipeline", env="FLOTILLA_NO_PIPELINE", switch=True, help="deploy no first pipeline")
    up.add_flag("--gpus", env="FLOTILLA_GPUS", type=_gpus, help="simulated GPUs of the local node, e.g. 2x24GiB")
    up.add_flag(
        "--no-api-keys",
        env="FLOTILLA_UP_NO_API_KEYS",
        switch=True,
        help="let the gateway serve /v1/* without an API key (by default it needs one; the first is printed once "
        "and kept in DATA_DIR/api.key)",
    )
    default = RestartPolicy()
    up.add_flag(
        "--restart-burst",
        env="FLOTILLA_UP_RESTART_BURST",
        type=_count,
        default=default.burst,
        help="restarts allowed of a part that ends, within --restart-window; 0: its end stops the stack "
        f"({default.burst})",
    )
    up.add_flag(
        "--restart-window",
        env="FLOTILLA_UP_RESTART_WINDOW_S",
        type=_seconds,
        default=default.window_s,
        help=f"seconds in which --restart-burst restarts are allowed ({default.window_s:.0f})",
    )
    up.add_flag(
        "--retry-given-up",
        env="FLOTILLA_UP_RETRY_GIVEN_UP_S",
        type=_seconds,
        default=default.retry_given_up_s,
        help="seconds after which a part the gateway does not need, given up on, is started again "
        f"({default.retry_given_up_s:.0f})",
    )
    up.add_argument("-v", "--verbose", action="count", default=0, help="-v for debug logs")
    return up


def parse_up_options(parser: EnvArgumentParser, namespace: argparse.Namespace) -> UpOptions:
    """The checked options. Raises ConfigError (a variable, the model) or exits through parser.error()."""
    parser.check_environment()
    ports = {
        "--http-port": namespace.http_port,
        "--control-plane-port": namespace.control_plane_port,
    }
    for flag, port in ports.items():
        if port == 0:
            parser.error(f"{flag} needs a port number (0, any free port, is only for etcd, NATS and Redis)")
    if namespace.http_port == namespace.control_plane_port:
        parser.error("--http-port and --control-plane-port must differ")
    first_model = None if namespace.no_pipeline else first_model_of(namespace.model, namespace.engine)
    return UpOptions(
        http_port=namespace.http_port,
        control_plane_port=namespace.control_plane_port,
        etcd_port=namespace.etcd_port,
        nats_port=namespace.nats_port,
        redis_port=namespace.redis_port,
        data_dir=(namespace.data_dir or default_data_dir()).expanduser().absolute(),
        first_model=first_model,
        gpus=namespace.gpus,
        restarts=RestartPolicy(
            burst=namespace.restart_burst,
            window_s=namespace.restart_window,
            retry_given_up_s=namespace.retry_given_up,
        ),
        api_keys=not namespace.no_api_keys,
    )


def first_model_of(model: Path | None, engine: str) -> FirstModel:
    """The first pipeline's model: ``model`` (a GGUF file or model folder) or the default, checked for ``engine``.

    Raises ConfigError naming --model or --engine, ModelError when the files are not a model.
    """
    from runtime.models.loading import default_model_name
    from runtime.models.source import default_model_path, resolve_model

    if model is None:
        path = default_model_path()
    else:
        if not model.expanduser().exists():
            raise ConfigError(f"--model (FLOTILLA_MODEL_PATH): {str(model)!r} is no file or folder")
        path = resolve_model(str(model.expanduser())).absolute()
    if engine == "llamacpp":
        if not path.is_file():
            raise ConfigError(f"--engine llamacpp loads a GGUF file; --model {str(path)!r} is a folder")
        if importlib.util.find_spec("llama_cpp") is None:
            raise ConfigError(
                "--engine llamacpp: llama-cpp-python is not installed (`make install` builds it); "
                "or choose --engine mocker"
            )
    if engine == "mistralrs" and importlib.util.find_spec("mistralrs") is None:
        raise ConfigError(
            "--engine mistralrs: the mistralrs package is not installed: pip install 'flotilla[mistralrs]'"
        )
    # The catalog's name rule: letters, digits, '.', '_', '-', starting with a letter or digit.
    name = re.sub(r"[^A-Za-z0-9._-]", "-", default_model_name(path)).lstrip("._-")[:100] or "model"
    return FirstModel(name=name, source_kind="gguf" if path.is_file() else "folder", source=str(path), engine=engine)
