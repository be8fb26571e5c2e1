"""``manage.py planner``: the planner's loop (controlplane/planning/loop.py, docs/planner.md).

    manage.py planner                              # every $FLOTILLA_PLANNER_INTERVAL_S (default 10) seconds
    manage.py planner --interval 5 --nats nats://10.0.0.1:4222 --gateway http://10.0.0.2:8080
    manage.py planner --once                       # one turn, then exit (what it decided on stdout)
    manage.py planner --prometheus http://10.0.0.3:9090   # latencies from Prometheus (every ingress it scrapes)
    manage.py planner --ingress-metrics http://127.0.0.1:9101,http://127.0.0.1:9102   # from each ingress process

One process plans at a time (the ``planner`` lease); a second one waits and takes over when the first
stops or dies. NATS (``--nats``, $NATS_SERVER) and the gateway (``--gateway``, $FLOTILLA_GATEWAY_URL), or the
Prometheus that replaces it (``--prometheus``, $FLOTILLA_PLANNER_PROMETHEUS_URL), or the ingress processes' own
metrics URLs that replace it (``--ingress-metrics``, $FLOTILLA_PLANNER_INGRESS_METRICS: processes sharing one port,
each with its ``--metrics-port``), may be missing or come and go: each is logged with its address and the loop
goes on. A bad setting exits 2 (its
supervisor does not restart it for that); SIGTERM or Ctrl-C stops it between turns (exit 0).
"""

import asyncio
import contextlib
import logging
import signal
from typing import Any

import httpx
from django.core.management.base import BaseCommand, CommandError, CommandParser
from nats.aio.client import Client as NATS

from controlplane.command_args import nats_servers_flag, seconds_at_least
from controlplane.dashboard.gateway import gateway_url
from controlplane.planning.loop import DEFAULT_INTERVAL_S, PlannerLoop, run_loop
from runtime.cluster.nats_connection import close_nats, connect_nats
from runtime.config import env_float, env_str
from runtime.errors import ConfigError
from runtime.logging import configure_logging
from runtime.settings import nats_servers

log = logging.getLogger("controlplane.planning")


_seconds = seconds_at_least(0.1)


class Command(BaseCommand):
    help = "Plan the replicas of the pipelines that have planner targets: observe, decide and scale, every interval."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one turn, then exit")
        parser.add_argument(
            "--interval",
            type=_seconds,
            default=None,
            help=f"seconds between turns (default: $FLOTILLA_PLANNER_INTERVAL_S, else {DEFAULT_INTERVAL_S:g})",
        )
        parser.add_argument(
            "--nats",
            type=nats_servers_flag,
            default=None,
            help="NATS server(s), comma-separated (default: $NATS_SERVER)",
        )
        parser.add_argument(
            "--gateway", default=None, help="the gateway's base URL, for its /metrics (default: $FLOTILLA_GATEWAY_URL)"
        )
        parser.add_argument(
            "--prometheus",
            default=None,
            help="a Prometheus server's base URL: the ingresses' latency histograms are read there (every ingress "
            "it scrapes) in place of the gateway's /metrics (default: $FLOTILLA_PLANNER_PROMETHEUS_URL)",
        )
        parser.add_argument(
            "--ingress-metrics",
            default=None,
            metavar="URL[,URL...]",
            help="the base URLs of each ingress process's own /metrics (its --metrics-port), comma-separated: read "
            "in place of the gateway's when several processes share its port, each counted on its own (default: "
            "$FLOTILLA_PLANNER_INGRESS_METRICS)",
        )

    configures_logging = False

    def run_from_argv(self, argv: list[str]) -> None:
        self.configures_logging = True
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if self.configures_logging:
                configure_logging(env_str("FLOTILLA_LOG"), max(0, options["verbosity"] - 1))
            servers = options["nats"] or nats_servers()
            interval = options["interval"] or env_float("FLOTILLA_PLANNER_INTERVAL_S", DEFAULT_INTERVAL_S, minimum=0.1)
            gateway = options["gateway"].rstrip("/") if options["gateway"] else gateway_url()
            if gateway is not None and not gateway.startswith(("http://", "https://")):
                raise ConfigError(f"--gateway must be the gateway's http(s) base URL, not {gateway[:100]!r}")
            prometheus = options["prometheus"] or env_str("FLOTILLA_PLANNER_PROMETHEUS_URL") or None
            if prometheus is not None:
                prometheus = prometheus.rstrip("/")
                if not prometheus.startswith(("http://", "https://")):
                    raise ConfigError(
                        f"--prometheus (FLOTILLA_PLANNER_PROMETHEUS_URL) must be a Prometheus server's http(s) base "
                        f"URL, not {prometheus[:100]!r}"
                    )
            ingresses = ingress_metrics_urls(
                options["ingress_metrics"] or env_str("FLOTILLA_PLANNER_INGRESS_METRICS") or ""
            )
            if ingresses and prometheus is not None:
                raise ConfigError(
                    "--ingress-metrics (FLOTILLA_PLANNER_INGRESS_METRICS) and --prometheus "
                    "(FLOTILLA_PLANNER_PROMETHEUS_URL) are two sources of the same histograms: give one"
                )
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        if gateway is None and prometheus is None and not ingresses:
            log.warning("planner: no gateway URL (FLOTILLA_GATEWAY_URL, --gateway): planning in load mode only")
        asyncio.run(self._run(servers, gateway, prometheus, ingresses, interval, once=options["once"]))

    async def _run(
        self,
        servers: list[str],
        gateway: str | None,
        prometheus: str | None,
        ingresses: list[str],
        interval: float,
        *,
        once: bool,
    ) -> None:
        async with httpx.AsyncClient() as http:
            loop = PlannerLoop(
                gateway_url=gateway,
                prometheus_url=prometheus,
                ingress_metrics_urls=ingresses,
                interval_s=interval,
                http=http,
            )
            if once:
                await self._once(loop, servers)
                return
            stopping = asyncio.Event()
            running = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                running.add_signal_handler(signum, stopping.set)
            # NATS may be down: the loop plans without reports (load mode holds) while this keeps trying.
            connecting = asyncio.create_task(_connect(loop, servers), name="NATS")
            source = f"Prometheus {prometheus}" if prometheus else f"gateway {gateway or 'none'}"
            log.info("planner: every %g s; NATS at %s; latencies from %s", interval, ", ".join(servers), source)
            try:
                await run_loop(loop, stopping)
            finally:
                connecting.cancel()
                nc = await asyncio.gather(connecting, return_exceptions=True)
                if nc and isinstance(nc[0], NATS):
                    await close_nats(nc[0])

    async def _once(self, loop: PlannerLoop, servers: list[str]) -> None:
        """One turn, after a second of the workers' reports when NATS answers within it."""
        nc = None
        with contextlib.suppress(Exception):
            nc = await connect_nats(servers, name="flotilla-planner", wait=1.0)
            await loop.subscribe(nc)
            await asyncio.sleep(1.5)
        try:
            report = await loop.turn()
        finally:
            await loop.release()
            if nc is not None:
                await close_nats(nc)
        if not report.held_lease:
            self.stdout.write("another planner holds the lease; nothing decided")
            return
        self.stdout.write(f"decided: {report.decided}; acted: {report.acted}")
        for problem in report.problems:
            self.stderr.write(problem)


async def _connect(loop: PlannerLoop, servers: list[str]) -> Any:
    nc = await connect_nats(servers, name="flotilla-planner")
    await loop.subscribe(nc)
    log.info("planner: taking the workers' load reports from NATS at %s", ", ".join(servers))
    return nc


def ingress_metrics_urls(value: str) -> list[str]:
    """The URLs of ``--ingress-metrics``: comma-separated http(s) base URLs, each once. Raises ConfigError naming
    the first that is not one."""
    urls: list[str] = []
    for part in value.split(","):
        url = part.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
            raise ConfigError(
                f"--ingress-metrics (FLOTILLA_PLANNER_INGRESS_METRICS) takes http(s) base URLs, comma-separated "
                f"(an ingress process's --metrics-port), not {url[:100]!r}"
            )
        if url not in urls:
            urls.append(url)
    return urls
