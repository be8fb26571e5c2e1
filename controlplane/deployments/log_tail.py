"""A worker's log tail, asked of its node's agent: for GET /api/v1/instances/{id}/log/ and the dashboard.

Both answer the same way: the text, or why there is none with the HTTP status that says so (409: the
instance is not placed; 503: its node is offline, silent, or the broker is down; 502: the agent answered
with an error).
"""

from dataclasses import dataclass

from controlplane import celery_app
from controlplane.deployments.dispatch import AgentFailed, CeleryDispatcher, Dispatcher, DispatchError
from controlplane.deployments.models import Instance
from controlplane.errors import Invalid
from controlplane.fleet.models import Node
from runtime.config import env_float
from runtime.fleet_contract.tasks import MAX_LOG_LINES, LogTailRequest

DEFAULT_LOG_LINES = 100
#: The longest ``grep`` filter (a substring, not a pattern: nothing to compile, nothing to run away).
MAX_GREP_CHARS = 200


@dataclass(frozen=True)
class LogTail:
    """The log's text, or why there is none (``problem``) with the HTTP status the API gives."""

    instance: Instance
    lines: int
    text: str | None = None
    problem: str | None = None
    status: int = 200


def agent_dispatcher() -> Dispatcher:
    """How the control plane reaches agents: its Celery app (``FLOTILLA_BROKER_URL``)."""
    return CeleryDispatcher(celery_app.app)


def log_tail_timeout_s() -> float:
    """Seconds to wait for an agent's log tail: ``FLOTILLA_LOG_TAIL_TIMEOUT_S`` (default 5)."""
    return env_float("FLOTILLA_LOG_TAIL_TIMEOUT_S", 5.0, minimum=0.1)


def parse_lines(raw: str | None) -> int:
    """The ``lines`` parameter: DEFAULT_LOG_LINES when absent. Raises Invalid naming ``lines`` when it is not
    a whole number from 1 to MAX_LOG_LINES."""
    if raw is None or raw == "":
        return DEFAULT_LOG_LINES
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LOG_LINES:
        raise Invalid(f"a whole number from 1 to {MAX_LOG_LINES}, not {raw[:20]!r}", field="lines")
    return int(raw)


def parse_grep(raw: str | None) -> str:
    """The ``grep`` parameter: "" when absent. Raises Invalid naming ``grep`` when it is longer than
    MAX_GREP_CHARS or holds a control character (a line break cannot occur inside one line)."""
    if raw is None:
        return ""
    if len(raw) > MAX_GREP_CHARS:
        raise Invalid(f"at most {MAX_GREP_CHARS} characters, not {len(raw)}", field="grep")
    if any(ord(char) < 32 or ord(char) == 127 for char in raw):
        raise Invalid("text to find within one line: no line breaks, tabs or other control characters", field="grep")
    return raw


def filter_lines(text: str, grep: str) -> str:
    """The lines of ``text`` that contain ``grep``, ignoring case (all of them when ``grep`` is "")."""
    if not grep:
        return text
    wanted = grep.casefold()
    return "".join(line for line in text.splitlines(keepends=True) if wanted in line.casefold())


def log_tail(instance: Instance, lines: int) -> LogTail:
    """Ask the instance's node for the last ``lines`` of its worker log (waits up to ``log_tail_timeout_s``)."""
    node = instance.node
    if node is None:
        problem = f"instance {instance.name} is not placed on a node: it has no worker log"
        return LogTail(instance, lines, problem=problem, status=409)
    if node.state != Node.State.ONLINE:
        problem = f"node {node.name} is {node.state}: its agent cannot answer"
        return LogTail(instance, lines, problem=problem, status=503)
    request = LogTailRequest(instance_id=instance.pk, lines=lines)
    try:
        text = agent_dispatcher().log_tail(node.name, request, timeout_s=log_tail_timeout_s())
    except AgentFailed as exc:
        return LogTail(instance, lines, problem=str(exc), status=502)
    except DispatchError as exc:
        return LogTail(instance, lines, problem=str(exc), status=503)
    return LogTail(instance, lines, text=text)
