"""Which parts of ``flotilla up`` the OpenAI endpoint needs, and what no longer works while one of the others is down.

``flotilla up`` gives up on a part that keeps ending (``launcher/stack/restarts.py``). What it does then depends on
whether that part is on the serving path: what the gateway needs to go on answering chat completions with the engine
workers that run now.

* The serving path is the gateway itself, etcd (where the gateway finds the workers, their model cards and the API
  keys, and where the workers keep their leases) and NATS (which carries each request to a worker and its tokens
  back). Without any one of them every request fails, so giving up on it stops the whole stack, its log shown: a
  stack that cannot serve must not look as if it did.
* Every other part serves the operator or changes the fleet, and the gateway serves without it. The engine workers
  outlive the agent (their own sessions; a node whose workers sign that they are alive is never evicted, and a
  restarted agent adopts them); the gateway reads API keys from etcd, not from the control plane; with Redis away
  it counts keys' limits in memory and keeps its usage counts for later (``frontend_gateway/access/quotas.py``).
  Giving up on one of these stops nothing: ``flotilla up`` reports it loudly (what no longer works, its log, how to
  start it again), keeps serving, and starts it again every ``--retry-given-up`` seconds, a rate slow enough not to
  flood the logs and fast enough that a cause fixed meanwhile (a new agent token in its file, a disk with room
  again) heals without restarting the stack.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    """A part's place in the stack: ``serving`` when the OpenAI endpoint needs it; else ``without_it`` says what no
    longer works while it is down."""

    serving: bool
    without_it: str = ""


_SERVING = Role(serving=True)

#: Every long-running part ``flotilla up`` starts, by the name of its log file.
ROLES: dict[str, Role] = {
    "etcd": _SERVING,
    "nats": _SERVING,
    "gateway": _SERVING,
    "redis": Role(
        serving=False,
        without_it="the reconciler and the agent get no tasks (no engine worker is started, stopped or restarted), "
        "the dashboard does not update live, and the gateway counts API keys' limits on its own until Redis is back",
    ),
    "controlplane": Role(
        serving=False,
        without_it="the dashboard and the REST API do not answer, and the agent cannot report to the control plane",
    ),
    "celery": Role(
        serving=False,
        without_it="the reconciler does not run: no engine worker is placed, started, stopped or restarted, and "
        "API keys' usage is not written to the database",
    ),
    "live-bridge": Role(
        serving=False,
        without_it="the dashboard's pipeline pages do not update live (reload a page to see the latest)",
    ),
    "planner": Role(serving=False, without_it="the planner scales no pipeline"),
    "agent": Role(
        serving=False,
        without_it="node local's engine workers serve on, but none is started, stopped or restarted, and the "
        "node shows as offline",
    ),
}


def role_of(log_name: str) -> Role:
    """The role of the part that logs to ``log_name``.log. Raises KeyError for a part missing from ROLES: a new part
    must be classified here."""
    return ROLES[log_name]


def given_up_report(what: str, role: Role, log_path: str, log_tail: str, retry_s: float) -> str:
    """The lines that say ``flotilla up`` gave up on a part off the serving path: ``what`` happened (its name, how it
    ended, why no more restarts), what no longer works, its log's tail, and when and how it is started again."""
    lines = [
        f"flotilla up: ERROR: {what}.",
        "  The OpenAI endpoint does not need it: it goes on serving, and `flotilla up` keeps running.",
        f"  No longer works meanwhile: {role.without_it}.",
        f"  The last lines of its log ({log_path}):",
        *(f"    {line}" for line in log_tail.splitlines()),
        f"  `flotilla up` starts it again in {retry_s:.0f} s (--retry-given-up), and so after each give-up;",
        "  to start it at once, fix what its log says and restart `flotilla up` (Ctrl-C, then run it again).",
    ]
    return "\n".join(lines)
