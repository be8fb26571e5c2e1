"""``flotilla agent``: run this machine's node agent (agent/node_agent.py) until SIGTERM or Ctrl-C.

Every flag also reads an environment variable (shown in ``--help``), as a systemd unit's
``EnvironmentFile=`` sets them; the token may come from a file (``FLOTILLA_AGENT_TOKEN_FILE``).
"""

import argparse
import asyncio
import importlib.metadata
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from agent.control_plane_client import TokenRejected
from agent.inventory import parse_gpu_spec
from agent.machine_identity import valid_machine_id
from agent.node_agent import AgentSettings, run_agent
from agent.workers.worker_user import DEFAULT_WORKER_USER, resolve_worker_user
from launcher.arg_types import checked_by, number
from launcher.env_flags import EnvArgumentParser
from launcher.proctitle import set_title
from runtime.config import env_str
from runtime.errors import ConfigError, FlotillaError
from runtime.fleet_contract.tasks import node_queue
from runtime.logging import configure_logging
from runtime.models.hub_download import HubSettings
from runtime.settings import check_settings

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"

AGENT_DESCRIPTION = """\
Run this machine's node agent: it registers the node with the control plane, reports its GPUs, CPUs
and memory every few seconds, and takes the control plane's tasks from the node's own queue on the
broker (Redis): download a model, start an engine worker (`flotilla run in=dyn://... out=ENGINE`) on
the GPUs it was given, stop one (drain, terminate, kill), return a worker's log tail. Every state of
every instance goes back to the control plane; when it cannot be reached, the agent keeps working and
keeps its reports until it answers.

Workers outlive the agent: stopping or restarting it leaves them serving, and the next agent on the
node adopts them (it finds them through --state-dir). Workers find etcd and NATS through the agent's
ETCD_ENDPOINTS and NATS_SERVER, and readiness is their registration in etcd.
"""

AGENT_EPILOG = """\
a whole node, by hand (the control plane on 10.0.0.1; its admin creates the node's token):
  # on the control plane:  manage.py createtoken --agent gpu-a     (prints the token once)
  export FLOTILLA_CONTROL_PLANE=http://10.0.0.1:8000
  export FLOTILLA_AGENT_TOKEN_FILE=/etc/flotilla/agent-token    # or FLOTILLA_AGENT_TOKEN=flt_...
  export FLOTILLA_BROKER_URL=redis://10.0.0.1:6379/0
  export ETCD_ENDPOINTS=http://10.0.0.1:2379 NATS_SERVER=nats://10.0.0.1:4222
  flotilla agent --name gpu-a

a laptop acting as a node with two 24 GiB GPUs (simulated: run mocker workers on it):
  flotilla agent --control-plane http://127.0.0.1:8000 --token flt_... --name laptop --gpus 2x24GiB

models: Hugging Face repos are downloaded into --models-dir (HF_TOKEN for gated repos, HF_ENDPOINT,
  HF_HUB_OFFLINE=1 to use only what is there); local paths are checked, not copied.
logging: FLOTILLA_LOG=debug, or per module: FLOTILLA_LOG=agent=debug,info; -v, -vv
under systemd: KillMode=process, so that stopping the agent leaves its workers running
  (deploy/systemd/flotilla-agent.service)

exit codes (systemd units set RestartPreventExitStatus=2):
  0    stopped by SIGTERM, cleanly (the workers keep running)
  1    failed: restarting may help
  2    bad flags or variables, a token the control plane rejects, or a node name another machine
       registered: fix them, do not restart
  130  interrupted by Ctrl-C
"""


def _http_url(text: str) -> str:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL (e.g. http://10.0.0.1:8000)")
    try:
        parts.port  # noqa: B018  (a bad port raises)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text.strip().rstrip("/")


def _broker_url(text: str) -> str:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Redis URL (e.g. {DEFAULT_BROKER})")
    return text.strip()


def _node_name(text: str) -> str:
    checked_by(node_queue)(text)
    return text


def _gpus(text: str) -> list[int]:
    try:
        return parse_gpu_spec(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--gpus (FLOTILLA_GPUS): ")) from None


_machine_id = checked_by(valid_machine_id)
_seconds = number(0.1, 3600.0, unit="seconds")


def default_node_name(hostname: str | None = None) -> str:
    """This machine's host name as a node name: its first label, lowercased, other characters as '-'."""
    label = (hostname or socket.gethostname()).split(".")[0].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", label).strip("-")[:63].strip("-")
    return name or "node"


def _state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


def build_agent_parser() -> EnvArgumentParser:
    """The parser of ``flotilla agent``. Every option but ``-v`` has an environment variable."""
    parser = EnvArgumentParser(
        prog="flotilla agent",
        description=AGENT_DESCRIPTION,
        epilog=AGENT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_flag(
        "--control-plane",
        env="FLOTILLA_CONTROL_PLANE",
        type=_http_url,
        help="the control plane's base URL, e.g. http://10.0.0.1:8000 (required)",
    )
    parser.add_flag(
        "--token",
        env="FLOTILLA_AGENT_TOKEN",
        help="the node's agent token, from `manage.py createtoken --agent NAME` (required; or the file "
        "FLOTILLA_AGENT_TOKEN_FILE names, which keeps it out of the process list)",
    )
    parser.add_flag(
        "--name",
        env="FLOTILLA_NODE_NAME",
        type=_node_name,
        help="the node's name, which its token was made for (default: the host name as a DNS label, "
        f"here {default_node_name()!r})",
    )
    parser.add_flag(
        "--gpus",
        env="FLOTILLA_GPUS",
        type=_gpus,
        help='simulated GPUs instead of NVML\'s, e.g. "2x24GiB" or "24GiB,80GiB": their memory used is what '
        "the workers on them declare",
    )
    parser.add_flag(
        "--state-dir",
        env="FLOTILLA_STATE_DIR",
        type=Path,
        help="where the agent records its workers, to adopt them after a restart (default "
        "$XDG_STATE_HOME/flotilla/agent-NAME, i.e. ~/.local/state/flotilla/agent-NAME)",
    )
    parser.add_flag(
        "--models-dir",
        env="FLOTILLA_MODELS_DIR",
        type=Path,
        help="where Hugging Face models are downloaded (default: the hub's own cache, HF_HUB_CACHE); agents "
        "on one machine may share it",
    )
    parser.add_flag(
        "--log-dir",
        env="FLOTILLA_LOG_DIR",
        type=Path,
        help="where each worker's log is kept, as instance-ID.log (default: STATE_DIR/logs)",
    )
    parser.add_flag(
        "--broker",
        env="FLOTILLA_BROKER_URL",
        type=_broker_url,
        default=DEFAULT_BROKER,
        help=f"the Redis the control plane sends tasks through (default {DEFAULT_BROKER})",
    )
    parser.add_flag(
        "--heartbeat-s",
        env="FLOTILLA_HEARTBEAT_S",
        type=_seconds,
        default=5.0,
        help="seconds between heartbeats (default 5)",
    )
    parser.add_flag(
        "--reconcile-s",
        env="FLOTILLA_AGENT_RECONCILE_S",
        type=_seconds,
        default=30.0,
        help="seconds between comparisons of the workers with the control plane's instances of this node "
        "(also right after it answers again following an outage); workers it no longer places here are "
        "stopped (default 30)",
    )
    parser.add_flag(
        "--machine-id",
        env="FLOTILLA_MACHINE_ID",
        type=_machine_id,
        help="the id this machine registers its node with (default: /etc/machine-id, else a random one kept in "
        "STATE_DIR/machine-id); the control plane refuses another machine's agent under this node's name",
    )
    parser.add_flag(
        "--worker-user",
        env="FLOTILLA_WORKER_USER",
        help="the unprivileged user the engine workers run as, when the agent runs as root, so that they cannot "
        f"read its token (flotilla-agent.service: {DEFAULT_WORKER_USER}, which deploy/install.sh creates; default: "
        "the agent's own user)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for debug logs, -vv for trace")
    return parser


def agent_settings(parser: EnvArgumentParser, namespace: argparse.Namespace) -> AgentSettings:
    """The agent's settings from parsed flags; parser.error() for a missing one.

    Raises ConfigError for an environment variable its flag would refuse.
    """
    parser.check_environment()
    if not namespace.control_plane:
        parser.error("--control-plane (FLOTILLA_CONTROL_PLANE) is required: the control plane's base URL")
    if not namespace.token:
        parser.error(
            "--token (FLOTILLA_AGENT_TOKEN or FLOTILLA_AGENT_TOKEN_FILE) is required: create one on the control "
            "plane with `manage.py createtoken --agent NAME`"
        )
    node = namespace.name or _node_name(default_node_name())
    state_dir = namespace.state_dir or _state_home() / "flotilla" / f"agent-{node}"
    if namespace.models_dir is not None:
        models_dir = namespace.models_dir
    else:
        from huggingface_hub import constants

        models_dir = Path(constants.HF_HUB_CACHE)
    return AgentSettings(
        control_plane_url=namespace.control_plane,
        token=namespace.token.strip(),
        node=node,
        state_dir=state_dir,
        models_dir=models_dir,
        log_dir=namespace.log_dir or state_dir / "logs",
        broker_url=namespace.broker,
        simulated_gpus=namespace.gpus,
        heartbeat_s=namespace.heartbeat_s,
        reconcile_s=namespace.reconcile_s,
        version=_version(),
        machine_id=namespace.machine_id or "",
        worker_user=resolve_worker_user(namespace.worker_user),
    )


def _version() -> str:
    try:
        return importlib.metadata.version("flotilla")
    except importlib.metadata.PackageNotFoundError:
        return ""


def agent_main(args: list[str]) -> int:
    """``flotilla agent ARGS``; returns the exit code (see AGENT_EPILOG)."""
    parser = build_agent_parser()
    namespace = parser.parse_args(args)
    try:
        configure_logging(env_str("FLOTILLA_LOG"), namespace.verbose)
        settings = agent_settings(parser, namespace)
        set_title(f"flotilla agent {settings.node}")
        # What the workers will read is checked now, so a bad variable stops the agent, not each worker.
        check_settings()
        HubSettings.from_environment()
        import uvloop

        return uvloop.run(_serve(settings))
    except (TokenRejected, ConfigError) as exc:
        print(f"flotilla agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except FlotillaError as exc:
        print(f"flotilla agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


async def _serve(settings: AgentSettings) -> int:
    """Run the agent until SIGTERM (exit 0) or SIGINT (130). Raises what run_agent raises."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        if not received:
            log.info("received %s: stopping the agent (its workers keep running)", signal.Signals(signum).name)
        received.append(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await run_agent(settings, stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    return EXIT_INTERRUPTED if received and received[0] == signal.SIGINT else EXIT_OK
