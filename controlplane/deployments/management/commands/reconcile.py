"""``manage.py reconcile``: the reconciler's pass in a loop, without Celery's worker and beat.

    manage.py reconcile                  # a pass every FLOTILLA_RECONCILE_S seconds (default 2) until stopped
    manage.py reconcile --once           # one pass, then exit
    manage.py reconcile --interval 0.5

Tasks for agents still go through the broker (``FLOTILLA_BROKER_URL``): that is how agents hear them.
SIGTERM or Ctrl-C ends the loop between passes. Passes share the Celery task's lease, so running this
beside a Celery worker is harmless: they take turns.
"""

import signal
import threading
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from controlplane import celery_app
from controlplane.command_args import seconds_at_least
from controlplane.deployments.dispatch import CeleryDispatcher
from controlplane.deployments.reconciler import PassReport, Reconciler, ReconcilerSettings
from runtime.errors import ConfigError

_seconds = seconds_at_least(0.1)


class Command(BaseCommand):
    help = "Reconcile the fleet with the desired state: a pass every --interval seconds, or one with --once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="run one pass and exit")
        parser.add_argument(
            "--interval",
            type=_seconds,
            default=None,
            help="seconds between passes (default: FLOTILLA_RECONCILE_S, else 2)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            settings = ReconcilerSettings.from_env()
        except ConfigError as exc:
            raise CommandError(str(exc)) from exc
        interval = options["interval"] or settings.interval_s
        reconciler = Reconciler(CeleryDispatcher(celery_app.app), settings)
        stopping = threading.Event()
        if not options["once"]:
            _stop_on_signals(stopping)
            self.stderr.write(f"reconciling every {interval:g} s; Ctrl-C or SIGTERM stops")
        while True:
            try:
                report = reconciler.run_once()
            except DatabaseError as exc:
                if options["once"]:
                    raise CommandError(f"the pass failed: the database said {exc}") from exc
                # The database may be restarting: the loop is what retries.
                self.stderr.write(f"the pass failed: the database said {exc}; trying again in {interval:g} s")
                report = PassReport()
            if report is None:
                self.stderr.write("another pass is running (a Celery worker?); it runs once more instead")
            elif report.changed or options["once"]:
                self.stdout.write(report.summary())
            if options["once"] or stopping.wait(interval):
                return


def _stop_on_signals(stopping: threading.Event) -> None:
    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
