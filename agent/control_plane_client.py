"""The agent's side of the control plane's REST API (``/api/v1/agent/…``), called with the node's token.

``register`` and ``heartbeat`` send the node's inventory; ``list_instances`` reads what the control plane
has placed on this node; ``report_instance`` and ``report_download`` queue news for it. Reports go
through an outbox that keeps the latest report per instance (and per model, for downloads) until the
control plane has taken it: an outage loses nothing, and what is sent when it is back is only what is
still news (the control plane's state machine allows the forward skips this causes).

An unreachable control plane (no connection, a timeout, a 5xx) is logged once per outage, naming the
URL and why, and retried with backoff; the client never gives up on it. What the control plane refuses
is not retried: a 409 (a stale state, the instance moved on) is logged at info and dropped, a 400 or
403 about one report is logged as a warning and dropped. A rejected token (401, or a 403 at
registration) is fatal: ``rejected`` resolves with a TokenRejected whose message says what to do; so is
a 409 to a registration or a heartbeat (OtherMachine: another machine has this node's name).

Some answers cast doubt on the agent's workers: the control plane answering again after an outage (it
may have moved or stopped instances meanwhile), and a report about an instance answered 403 (placed on
another node now), 404 (deleted) or 409 (it moved on). ``doubt()`` returns when one came, saying which,
so that the agent compares its workers with ``list_instances()``; the client itself stops nothing.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import httpx
import msgspec

from agent.control_plane_clock import ControlPlaneClock
from agent.errors import AgentError
from agent.inventory import NodeInventory
from runtime.backoff import Backoff
from runtime.errors import ConfigError
from runtime.fleet_contract.reports import AdapterFailure, GpuReport
from runtime.fleet_contract.reports import DownloadReport as DownloadReport
from runtime.fleet_contract.reports import InstanceReport as InstanceReport
from runtime.fleet_contract.reports import NodeReport as NodeReport

log = logging.getLogger(__name__)

API = "api/v1/agent/"
#: The control plane caps an instance's failure reason at this many characters.
MAX_REASON_CHARS = 4000
#: Retries after an outage wait a random 50 to 100 % of their delay: every agent of a fleet lost the control
#: plane at the same moment, and would otherwise knock again all together, on the same doubling schedule.
CONTROL_PLANE_RETRY_JITTER = 0.5


class TokenRejected(AgentError):
    """The control plane refused the agent's token (unknown, revoked, expired, or another node's)."""


class OtherMachine(TokenRejected):
    """The control plane refused the node: another machine registered its name (a 409). Fatal as a rejected
    token is: only a person can fix it (another ``--name``, or deleting the node)."""


class ControlPlaneRefused(AgentError):
    """The control plane answered a request with an error that retrying cannot change."""


class ControlPlaneUnreachable(AgentError):
    """The control plane did not answer (no connection, a timeout, or a 5xx): it may answer later."""

    retryable = True


class NodeNotRegistered(AgentError):
    """The control plane does not know this node (its database was reset, or an admin deleted the node)."""

    retryable = True


# What the agent sends: the reports of runtime/fleet_contract/reports.py (exported here too, ``as``, for the agent's
# modules that hand them to the client).


def node_report(
    inventory: NodeInventory,
    *,
    name: str,
    address: str = "",
    labels: Mapping[str, str] | None = None,
    version: str = "",
    machine_id: str = "",
    engines: Collection[str] = (),
    adapter_failures: list[AdapterFailure] | None = None,
) -> NodeReport:
    """The API's report of ``inventory`` for node ``name`` on machine ``machine_id``, which runs ``engines``."""
    return NodeReport(
        name=name,
        address=address or inventory.hostname,
        labels=dict(labels or {}),
        cpu_count=inventory.cpu_count,
        memory_total_bytes=inventory.memory_total_bytes,
        memory_available_bytes=inventory.memory_available_bytes,
        agent_version=version,
        gpus=[
            GpuReport(
                index=gpu.index,
                name=gpu.name,
                uuid=gpu.uuid,
                memory_total_bytes=gpu.memory_total_bytes,
                memory_used_bytes=gpu.memory_used_bytes,
                utilization_percent=gpu.utilization_percent,
            )
            for gpu in inventory.gpus
        ],
        machine_id=machine_id,
        engines=sorted(engines),
        cpu_utilization_percent=inventory.cpu_utilization_percent,
        adapter_failures=adapter_failures,
    )


# What the control plane answers.


class HeartbeatReply(msgspec.Struct, frozen=True):
    name: str
    state: str
    draining: bool


class AgentModel(msgspec.Struct, frozen=True):
    id: int


class AgentInstance(msgspec.Struct, frozen=True, kw_only=True):
    """An instance the control plane placed on this node (the fields the agent uses)."""

    id: int
    state: str
    #: The attempt the control plane is at (its restart count); None from a control plane that does not say.
    attempt: int | None = None
    #: The instance row's random id (runtime/fleet_contract/tasks.py); "" from a control plane that does not say.
    incarnation: str = ""
    restart_requested: bool = False
    model: AgentModel | None = None


def fit_reason(reason: str, limit: int = MAX_REASON_CHARS) -> str:
    """``reason`` cut to ``limit`` characters, keeping its start (what happened) and its end (the log's last lines)."""
    if len(reason) <= limit:
        return reason
    cut = "\n[…]\n"
    head = limit // 4
    return reason[:head] + cut + reason[-(limit - head - len(cut)) :]


class _Outage:
    """Whether the control plane answers; logs each outage once, when it starts and when it ends."""

    def __init__(self, url: str, on_back: Callable[[float], None] | None = None) -> None:
        """``on_back`` is called with the outage's length in seconds when the control plane answers again."""
        self.url = url
        self.down_since: float | None = None
        #: Set when the control plane answers after an outage: report senders waiting out a backoff resume.
        self.answered = asyncio.Event()
        self._on_back = on_back

    def lost(self, reason: str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.answered.clear()
            log.warning(
                "cannot reach the control plane at %s (%s); retrying with backoff, keeping reports until it answers",
                self.url,
                reason,
            )

    def back(self) -> None:
        if self.down_since is not None:
            seconds = time.monotonic() - self.down_since
            log.info("the control plane at %s answers again (after %.0f s without it)", self.url, seconds)
            self.down_since = None
            if self._on_back is not None:
                self._on_back(seconds)
        self.answered.set()


_OutboxKey = tuple[str, int]  # ("instance", id) or ("download", model id)


class ControlPlaneClient:
    """One agent's connection to the control plane, made on the loop that uses it; ``async with`` it (it
    owns the task that sends the reports)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        node: str,
        timeout_s: float = 10.0,
        backoff: Backoff | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        user_agent: str = "flotilla-agent",
    ) -> None:
        """``base_url`` is the control plane's (``http://host:8000``); ``backoff`` paces the retries while it
        does not answer (each retry loop starts a ``fresh()`` one); ``transport`` replaces the network (tests)."""
        self.base_url = base_url.rstrip("/")
        self.node = node
        #: The control plane's clock, from the Date of its answers: the agent's tasks expire on it.
        self.clock = ControlPlaneClock()
        self._backoff = backoff or Backoff(0.5, 10.0, jitter=CONTROL_PLANE_RETRY_JITTER)
        self._http = httpx.AsyncClient(
            base_url=self.base_url + "/",
            headers={"Authorization": f"Bearer {token}", "User-Agent": user_agent},
            timeout=timeout_s,
            transport=transport,
        )
        self._outage = _Outage(self.base_url, on_back=self._reconnected)
        self._doubted = asyncio.Event()
        self._doubt_why = ""
        self._outbox: dict[_OutboxKey, InstanceReport | DownloadReport] = {}
        self._queued = asyncio.Event()
        self._emptied = asyncio.Event()
        self._emptied.set()
        self._sender: asyncio.Task[None] | None = None
        #: Resolves (with the error, as its result) when the control plane rejects the token.
        self.rejected: asyncio.Future[TokenRejected] = asyncio.get_running_loop().create_future()

    async def __aenter__(self) -> "ControlPlaneClient":
        self._sender = asyncio.create_task(self._send_reports(), name="send reports to the control plane")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop sending (reports still queued are dropped: ``flush()`` first to send them) and close."""
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
            self._sender = None
        await self._http.aclose()

    @property
    def reachable(self) -> bool:
        """Whether the last request got an answer."""
        return self._outage.down_since is None

    async def doubt(self) -> str:
        """Wait until an answer casts doubt on the agent's workers (see the module's docstring); returns what
        it was. Doubts that come while nobody waits are kept, as one (the latest says why)."""
        await self._doubted.wait()
        self._doubted.clear()
        return self._doubt_why

    def _doubt(self, why: str) -> None:
        self._doubt_why = why
        self._doubted.set()

    def _reconnected(self, seconds: float) -> None:
        self._doubt(f"the control plane may have changed it during the {seconds:.0f} s this agent was cut off")

    # -- registration and heartbeats -----------------------------------------------------------------

    async def register(self, report: NodeReport) -> None:
        """Register the node, retrying with backoff for as long as the control plane does not answer.

        Raises TokenRejected (401, or 403: the token is another node's, or not an agent's), OtherMachine
        (409: another machine has this node's name), ConfigError when the URL is not the control plane (404),
        ControlPlaneRefused for another refusal.
        """
        backoff = self._backoff.fresh()
        conflicts = 0
        while True:
            try:
                response = await self._post("register/", report)
            except ControlPlaneUnreachable:
                await asyncio.sleep(backoff.next())
                continue
            if response.status_code == 200:
                log.info("registered node %s with the control plane at %s", self.node, self.base_url)
                return
            if response.status_code == 403:
                raise self._reject(response)
            if response.status_code == 409:
                conflicts += 1
                if conflicts == 1:  # maybe this agent's own earlier try, which timed out, racing this one
                    await asyncio.sleep(backoff.next())
                    continue
                raise self._other_machine(response)
            if response.status_code == 404:
                raise ConfigError(
                    f"{response.request.url} answered 404 Not Found: give the control plane's base URL "
                    "(e.g. http://127.0.0.1:8000) as --control-plane (FLOTILLA_CONTROL_PLANE)"
                )
            raise ControlPlaneRefused(f"the control plane refused to register node {self.node}: {_detail(response)}")

    async def heartbeat(self, report: NodeReport) -> HeartbeatReply | None:
        """Send the node's inventory; None when the control plane did not answer (it is retried next time).

        Raises NodeNotRegistered (register again), TokenRejected, OtherMachine.
        """
        try:
            response = await self._post("heartbeat/", report)
        except ControlPlaneUnreachable:
            return None
        if response.status_code == 404:
            raise NodeNotRegistered(f"the control plane at {self.base_url} does not know node {self.node}")
        if response.status_code == 403:
            raise self._reject(response)
        if response.status_code == 409:
            raise self._other_machine(response)
        if response.status_code != 200:
            log.warning("the control plane refused a heartbeat: %s", _detail(response))
            return None
        try:
            return msgspec.json.decode(response.content, type=HeartbeatReply)
        except msgspec.DecodeError as exc:
            log.warning("the control plane's heartbeat reply is not what the agent expects (%s)", exc)
            return None

    async def list_instances(self) -> list[AgentInstance]:
        """The instances placed on this node that are not stopped.

        Raises ControlPlaneUnreachable, TokenRejected, ControlPlaneRefused.
        """
        try:
            response = await self._request("GET", API + "instances/")
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code == 403:
            raise self._reject(response)
        if response.status_code != 200:
            raise ControlPlaneRefused(f"the control plane refused the list of instances: {_detail(response)}")
        try:
            return msgspec.json.decode(response.content, type=list[AgentInstance])
        except msgspec.DecodeError as exc:
            raise ControlPlaneRefused(
                f"the control plane's list of instances is not what the agent expects: {exc}"
            ) from exc

    # -- reports --------------------------------------------------------------------------------------

    def report_instance(self, instance_id: int, report: InstanceReport) -> None:
        """Queue ``report``; it replaces a report of the same instance that has not been sent yet."""
        if report.reason:
            report = msgspec.structs.replace(report, reason=fit_reason(report.reason))
        self._queue(("instance", instance_id), report)

    def report_download(self, model_id: int, report: DownloadReport) -> None:
        """Queue ``report``; it replaces a report of the same model's download that has not been sent yet."""
        if report.error:
            report = msgspec.structs.replace(report, error=fit_reason(report.error))
        self._queue(("download", model_id), report)

    @property
    def pending_reports(self) -> int:
        return len(self._outbox)

    async def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued report to be sent (or dropped); whether they were."""
        emptied = asyncio.create_task(self._emptied.wait())
        waited: list[asyncio.Future[Any]] = [emptied, self.rejected]
        try:
            # A rejected token ends the sending: waiting longer would not empty the outbox.
            await asyncio.wait(waited, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            emptied.cancel()
        return self._emptied.is_set()

    def _queue(self, key: _OutboxKey, report: InstanceReport | DownloadReport) -> None:
        self._outbox[key] = report
        self._emptied.clear()
        self._queued.set()

    async def _send_reports(self) -> None:
        """Send queued reports, oldest first, one at a time; wait out outages with backoff."""
        backoff = self._backoff.fresh()
        while True:
            if not self._outbox:
                self._emptied.set()
                self._queued.clear()
                await self._queued.wait()
                continue
            key, report = next(iter(self._outbox.items()))
            try:
                await self._send(key, report)
            except ControlPlaneUnreachable:
                # Wait for the backoff, or less if another request finds the control plane back first.
                self._outage.answered.clear()
                try:
                    async with asyncio.timeout(backoff.next()):
                        await self._outage.answered.wait()
                except TimeoutError:
                    pass
                continue
            except TokenRejected:
                return  # ``rejected`` says why; the agent stops
            except Exception:
                # A bug must not silence every later report: drop this one, say so, go on.
                log.exception("sending %s %d's report %s failed; dropping it", key[0], key[1], report)
            backoff.reset()
            # Sent (or refused for good): forget it, unless a newer report replaced it meanwhile.
            if self._outbox.get(key) is report:
                del self._outbox[key]

    async def _send(self, key: _OutboxKey, report: InstanceReport | DownloadReport) -> None:
        """Send one report. Raises ControlPlaneUnreachable (keep it), TokenRejected; logs refusals."""
        kind, number = key
        if kind == "instance":
            response = await self._post(f"instances/{number}/state/", report)
            what = f"instance {number}'s state {report.state}"
        else:
            response = await self._post("downloads/", {"model": number, **msgspec.to_builtins(report)})
            what = f"model {number}'s download ({report.state})"
        status = response.status_code
        if status == 200:
            log.debug("reported %s", what)
        elif status == 409:
            # The instance moved on (stopped, restarted): this news is stale, and retrying cannot change that.
            log.info("the control plane declined %s as stale: %s", what, _detail(response))
        elif status == 404:
            log.info("the control plane no longer knows %s %d: dropping its report (%s)", kind, number, what)
        else:
            log.warning("the control plane refused %s (%d): %s", what, status, _detail(response))
        if kind == "instance" and status in (403, 404, 409):
            # Whether the worker is still wanted is for the list of the node's instances to say, not this answer
            # (a 409 may be about one transition only).
            self._doubt(f"the control plane answered {status} to {what}")

    # -- HTTP -----------------------------------------------------------------------------------------

    async def _post(self, path: str, body: object) -> httpx.Response:
        """POST ``body`` as JSON to an agent endpoint. Raises ControlPlaneUnreachable, TokenRejected (401)."""
        try:
            return await self._request(
                "POST", API + path, content=msgspec.json.encode(body), headers={"Content-Type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request. Raises httpx.HTTPError, ControlPlaneUnreachable (5xx), TokenRejected (401)."""
        sent_at = time.time()
        response = await self._http.request(method, path, **kwargs)
        self.clock.observe(response.headers.get("date"), sent_at, time.time())
        if response.status_code >= 500:
            self._outage.lost(f"{method} {path} answered {response.status_code}")
            raise ControlPlaneUnreachable(f"the control plane at {self.base_url} answered {response.status_code}")
        self._outage.back()
        if response.status_code == 401:
            raise self._reject(response)
        return response

    def _unreachable(self, exc: httpx.HTTPError) -> ControlPlaneUnreachable:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._outage.lost(reason)
        return ControlPlaneUnreachable(f"cannot reach the control plane at {self.base_url} ({reason})")

    def _reject(self, response: httpx.Response) -> TokenRejected:
        error = TokenRejected(
            f"the control plane at {self.base_url} rejected the agent token of node {self.node} "
            f"({response.status_code}: {_detail(response)}). Give the token that "
            f"`manage.py createtoken --agent {self.node}` printed, with --token (FLOTILLA_AGENT_TOKEN or "
            "FLOTILLA_AGENT_TOKEN_FILE), and the node name it was made for with --name (FLOTILLA_NODE_NAME)"
        )
        if not self.rejected.done():
            self.rejected.set_result(error)
        return error

    def _other_machine(self, response: httpx.Response) -> OtherMachine:
        error = OtherMachine(f"the control plane at {self.base_url} refused this agent: {_detail(response)}")
        if not self.rejected.done():
            self.rejected.set_result(error)
        return error


def _detail(response: httpx.Response) -> str:
    """What the control plane said: DRF's ``detail``, field errors, or the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return str(body["detail"])
    return str(body)[:300]
