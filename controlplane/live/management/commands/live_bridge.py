"""``manage.py live_bridge``: the workers' load on NATS, pushed live to the dashboard's pipeline pages; and the
gateways' request records, stored as the request log with the metric samples (controlplane/traffic/recorder.py).

    manage.py live_bridge                                  # NATS at $NATS_SERVER (default nats://127.0.0.1:4222)
    manage.py live_bridge --nats nats://10.0.0.1:4222 --nats-timeout 120

It waits for NATS at start-up (warning every few seconds which server it cannot reach) and exits 1 when
NATS does not answer within ``--nats-timeout`` seconds, then or later: its supervisor (systemd,
``flotilla up``) starts it again. Redis (the channel layer, FLOTILLA_REDIS_URL or the broker's) and the
database may come and go: what fails meanwhile is logged and skipped. SIGTERM or Ctrl-C stops it (exit 0).
"""

import asyncio
import logging
import signal
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.command_args import nats_servers_flag, seconds_at_least
from controlplane.live.bridge import (
    DEFAULT_INTERVAL_S,
    DEFAULT_NATS_TIMEOUT_S,
    BridgeError,
    InstanceDirectory,
    LiveBridge,
    NatsWatch,
    read_directory,
)
from controlplane.live.publisher import layer_address
from controlplane.traffic.recorder import Retention, TrafficRecorder, sample_window_s
from runtime.cluster.nats_connection import close_nats, connect_nats
from runtime.config import env_float, env_str
from runtime.errors import ConfigError, RequestPlaneUnavailable
from runtime.logging import configure_logging
from runtime.settings import nats_servers
from runtime.supervision import Supervisor

log = logging.getLogger("controlplane.live")


_seconds = seconds_at_least(0.01)


class Command(BaseCommand):
    help = "Push the workers' load metrics and KV events from NATS to the dashboard's pipeline pages."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--nats",
            type=nats_servers_flag,
            default=None,
            help="NATS server(s), comma-separated (default: $NATS_SERVER)",
        )
        parser.add_argument(
            "--nats-timeout",
            type=_seconds,
            default=None,
            help="exit 1 when NATS stays unreachable this long "
            f"(default: $FLOTILLA_LIVE_NATS_TIMEOUT_S, else {DEFAULT_NATS_TIMEOUT_S:g})",
        )
        parser.add_argument(
            "--interval",
            type=_seconds,
            default=None,
            help="fewest seconds between two pushes of one instance's load "
            f"(default: $FLOTILLA_LIVE_INTERVAL_S, else {DEFAULT_INTERVAL_S:g})",
        )

    # Logging is the process's to set up, only when this command is the process (not under call_command).
    configures_logging = False

    def run_from_argv(self, argv: list[str]) -> None:
        self.configures_logging = True
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if self.configures_logging:
                configure_logging(env_str("FLOTILLA_LOG"), max(0, options["verbosity"] - 1))
            servers = options["nats"] or nats_servers()
            timeout = options["nats_timeout"] or env_float(
                "FLOTILLA_LIVE_NATS_TIMEOUT_S", DEFAULT_NATS_TIMEOUT_S, minimum=0.01
            )
            interval = options["interval"] or env_float("FLOTILLA_LIVE_INTERVAL_S", DEFAULT_INTERVAL_S, minimum=0.01)
            retention = Retention.from_environment()
            sample_s = sample_window_s()
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        try:
            asyncio.run(run_bridge(servers, timeout, interval, retention, sample_s))
        except (RequestPlaneUnavailable, BridgeError) as exc:
            raise CommandError(str(exc)) from exc


async def run_bridge(
    servers: list[str], nats_timeout: float, interval: float, retention: Retention, sample_s: float
) -> None:
    """Run the bridge until SIGTERM/SIGINT, writing the metric samples every ``sample_s`` seconds. Raises
    RequestPlaneUnavailable when NATS does not answer within ``nats_timeout`` at start, BridgeError when it is
    lost that long later."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    layer = get_channel_layer()
    if layer is None:
        raise BridgeError("no channel layer is configured (CHANNEL_LAYERS)")
    watch = NatsWatch(", ".join(servers), nats_timeout)
    nc = await connect_nats(servers, name="flotilla-live-bridge", on_event=watch.on_event, wait=nats_timeout)
    supervisor = Supervisor(on_fatal=stopping.set)
    directory = InstanceDirectory(database_sync_to_async(read_directory))
    bridge = LiveBridge(nc, layer, directory, supervisor, interval=interval)
    # The request log and the metric samples share the bridge's NATS connection and directory.
    recorder = TrafficRecorder(
        nc, directory, supervisor, loads=bridge.latest_loads, sample_s=sample_s, retention=retention
    )
    watching = asyncio.create_task(watch.watch(), name="NATS watch")
    stop = asyncio.create_task(stopping.wait(), name="stop")
    try:
        bridge.start()
        recorder.start()
        log.info("live bridge: NATS at %s -> channel layer at %s", watch.address, layer_address(layer))
        await asyncio.wait({watching, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watching, stop):
            task.cancel()
        await supervisor.close()
        await bridge.close()
        await close_nats(nc)
    if watching.done() and not watching.cancelled():
        watching.result()  # raises BridgeError: NATS lost too long
    if supervisor.failure is not None:
        raise BridgeError(supervisor.failure)
