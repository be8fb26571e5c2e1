"""The control plane's Celery app: the reconciler's periodic task, and the broker that carries agents' tasks.

* Broker and result backend: Redis at ``FLOTILLA_BROKER_URL`` (default ``redis://127.0.0.1:6379/0``);
  results are kept only for what the control plane waits on (an agent's log tail).
* JSON only, both ways: agents decode the payloads of ``runtime.fleet_contract.tasks`` with msgspec.
* Beat runs the reconcile task every ``FLOTILLA_RECONCILE_S`` seconds (default 2) on queue
  ``controlplane`` (``runtime.fleet_contract.tasks.CONTROL_PLANE_QUEUE``), which only the control plane's own
  worker consumes; agents consume ``node.<name>``.

Run it as ``celery -A controlplane.celery_app worker -Q controlplane`` plus ``celery -A
controlplane.celery_app beat`` (or ``worker -B`` for one process). ``manage.py reconcile`` runs the same
pass without Celery.

Actions that change desired state call ``controlplane.reconcile_requests.request_reconcile()``, whose sender
is ``send_reconcile_request`` here: a pass runs right after their commit instead of up to one interval
later. When no broker answers, that is logged and dropped; beat comes anyway.
"""

import logging
import os
from pathlib import Path

from celery import Celery
from kombu.exceptions import OperationalError
from kombu.utils.url import maybe_sanitize_url

from controlplane.secret_key import default_data_dir
from runtime.config import env_float, env_str
from runtime.errors import ConfigError
from runtime.fleet_contract.broker import celery_redis_settings
from runtime.fleet_contract.tasks import BATCHES_QUEUE, CONTROL_PLANE_QUEUE

# Celery's worker and beat import this module first: they need Django's settings to load the tasks.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

log = logging.getLogger(__name__)

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
#: The reconciler's one pass (controlplane/deployments/tasks.py).
RECONCILE_TASK = "flotilla.controlplane.reconcile"
SYNC_API_KEYS_TASK = "flotilla.controlplane.sync_api_keys"
DRAIN_USAGE_TASK = "flotilla.controlplane.drain_usage"
SYNC_SERVED_NAMES_TASK = "flotilla.controlplane.sync_served_names"
#: A slice of one batch's run (controlplane/batches/), and the upkeep that restarts orphaned batches.
RUN_BATCH_TASK = "flotilla.controlplane.run_batch"
BATCH_UPKEEP_TASK = "flotilla.controlplane.batch_upkeep"
#: Stored responses past their keeping time deleted (controlplane/stored_responses/).
EXPIRE_RESPONSES_TASK = "flotilla.controlplane.expire_responses"
#: The alert rules evaluated and their notifications sent (controlplane/alerts/).
EVALUATE_ALERTS_TASK = "flotilla.controlplane.evaluate_alerts"

# Seconds a publish may wait for the broker's connection: an action's commit must not hang on a dead broker.
PUBLISH_CONNECT_TIMEOUT_S = 2.0
_BROKER_SCHEMES = ("redis://", "rediss://", "redis+socket://", "unix://", "memory://")


def broker_url() -> str:
    """``FLOTILLA_BROKER_URL`` or the default. Raises ConfigError for a URL Celery's Redis transport cannot use."""
    url = env_str("FLOTILLA_BROKER_URL") or DEFAULT_BROKER_URL
    if not url.startswith(_BROKER_SCHEMES):
        raise ConfigError(f"FLOTILLA_BROKER_URL={url!r} is not a Redis URL (redis://HOST:PORT/DB)")
    return url


def reconcile_interval_s() -> float:
    """Seconds between two reconciler passes: ``FLOTILLA_RECONCILE_S`` (default 2). Raises ConfigError."""
    return env_float("FLOTILLA_RECONCILE_S", 2.0, minimum=0.1)


def api_keys_sync_s() -> float:
    """``FLOTILLA_API_KEYS_SYNC_S``: how often etcd's API key records are checked against the database."""
    return env_float("FLOTILLA_API_KEYS_SYNC_S", 10.0, minimum=1.0)


def usage_drain_s() -> float:
    """``FLOTILLA_USAGE_DRAIN_S``: how often the API keys' usage is moved from Redis to the database."""
    return env_float("FLOTILLA_USAGE_DRAIN_S", 10.0, minimum=1.0)


def batch_upkeep_s() -> float:
    """``FLOTILLA_BATCH_UPKEEP_S``: how often batches that no runner holds are looked for (default 10)."""
    return env_float("FLOTILLA_BATCH_UPKEEP_S", 10.0, minimum=0.5)


def alerts_every_s() -> float:
    """``FLOTILLA_ALERT_EVERY_S``: how often the alert rules are evaluated (default 15)."""
    return env_float("FLOTILLA_ALERT_EVERY_S", 15.0, minimum=1.0)


def quota_redis_url() -> str:
    """``FLOTILLA_QUOTA_REDIS_URL``: the Redis where the ingresses count API keys' use (default: the broker)."""
    return env_str("FLOTILLA_QUOTA_REDIS_URL") or broker_url()


def create_app(broker: str | None = None, *, interval_s: float | None = None) -> Celery:
    """A Celery app on ``broker`` (default: ``broker_url()``) with the reconciler's schedule and routes."""
    url = broker or broker_url()
    interval = interval_s if interval_s is not None else reconcile_interval_s()
    celery = Celery("flotilla-controlplane")
    celery.conf.update(
        broker_url=url,
        result_backend=url,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        # Nothing of ours may land on Celery's default "celery" queue, which nobody consumes.
        task_default_queue=CONTROL_PLANE_QUEUE,
        task_routes={
            RECONCILE_TASK: {"queue": CONTROL_PLANE_QUEUE},
            SYNC_API_KEYS_TASK: {"queue": CONTROL_PLANE_QUEUE},
            DRAIN_USAGE_TASK: {"queue": CONTROL_PLANE_QUEUE},
            SYNC_SERVED_NAMES_TASK: {"queue": CONTROL_PLANE_QUEUE},
            RUN_BATCH_TASK: {"queue": BATCHES_QUEUE},
            BATCH_UPKEEP_TASK: {"queue": CONTROL_PLANE_QUEUE},
            EXPIRE_RESPONSES_TASK: {"queue": CONTROL_PLANE_QUEUE},
            EVALUATE_ALERTS_TASK: {"queue": CONTROL_PLANE_QUEUE},
        },
        beat_schedule={
            "reconcile": {
                "task": RECONCILE_TASK,
                "schedule": interval,
                # A pass that waited longer than an interval is overtaken by the next one: drop it.
                "options": {"queue": CONTROL_PLANE_QUEUE, "expires": interval},
            },
            # Etcd's API key records made equal to the database's (a change missed while etcd was down).
            "sync-api-keys": {
                "task": SYNC_API_KEYS_TASK,
                "schedule": api_keys_sync_s(),
                "options": {"queue": CONTROL_PLANE_QUEUE, "expires": api_keys_sync_s()},
            },
            # The served model names the ingresses answer "no ready replica" for (rather than "no such model").
            "sync-served-names": {
                "task": SYNC_SERVED_NAMES_TASK,
                "schedule": api_keys_sync_s(),
                "options": {"queue": CONTROL_PLANE_QUEUE, "expires": api_keys_sync_s()},
            },
            # Batches whose runner is gone (a restart mid-batch) taken up again.
            "batch-upkeep": {
                "task": BATCH_UPKEEP_TASK,
                "schedule": batch_upkeep_s(),
                "options": {"queue": CONTROL_PLANE_QUEUE, "expires": batch_upkeep_s()},
            },
            # Stored responses past FLOTILLA_RESPONSES_KEEP_S, deleted hourly.
            "expire-responses": {
                "task": EXPIRE_RESPONSES_TASK,
                "schedule": 3600.0,
                "options": {"queue": CONTROL_PLANE_QUEUE, "expires": 3600.0},
            },
            # The alert rules, and their webhook and email notifications.
            "evaluate-alerts": {
                "task": EVALUATE_ALERTS_TASK,
                "schedule": alerts_every_s(),
                "options": {"queue": CONTROL_PLANE_QUEUE, "expires": alerts_every_s()},
            },
            # The ingresses' usage counts, from Redis into the database.
            "drain-usage": {
                "task": DRAIN_USAGE_TASK,
                "schedule": usage_drain_s(),
                "options": {"queue": CONTROL_PLANE_QUEUE, "expires": usage_drain_s()},
            },
        },
        beat_schedule_filename=str(Path(env_str("FLOTILLA_DATA_DIR") or default_data_dir()) / "celerybeat-schedule"),
        broker_connection_timeout=PUBLISH_CONNECT_TIMEOUT_S,
        # Reading an answer retries a lost Redis once, not Celery's default 20 times a second apart: an
        # API request waiting on an agent's answer must fail in seconds.
        result_backend_transport_options={"retry_policy": {"max_retries": 1, "interval_start": 0.2}},
        broker_connection_retry_on_startup=True,
        result_expires=300,
        worker_prefetch_multiplier=1,
        timezone="UTC",
        enable_utc=True,
        # Every Redis command bounded (runtime/fleet_contract/broker.py); a publish tries a lost broker twice,
        # not kombu's default four times with sleeps (2 s) in between: the reconciler tries again on its next
        # pass anyway.
        **celery_redis_settings({"max_retries": 1, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.1}),
    )
    celery.autodiscover_tasks(
        [
            "controlplane.deployments",
            "controlplane.apikeys",
            "controlplane.batches",
            "controlplane.stored_responses",
            "controlplane.alerts",
        ]
    )
    return celery


app = create_app()


def send_reconcile_request(celery: Celery) -> bool:
    """Queue one reconciler pass on ``celery``'s broker; False (logged) when the broker does not take it."""
    try:
        celery.send_task(
            RECONCILE_TASK,
            queue=CONTROL_PLANE_QUEUE,
            retry=False,
            ignore_result=True,  # nobody waits for it: no subscription to its result either
            expires=reconcile_interval_s() * 5,
        )
    except (OperationalError, OSError) as exc:
        log.info(
            "no early reconciler pass: the broker %s did not take the request (%s); the periodic pass will come",
            maybe_sanitize_url(celery.conf.broker_url),
            exc,
        )
        return False
    return True


def send_batch_slice(batch_id: str) -> bool:
    """Queue a slice of ``batch_id``'s run; False (logged) when the broker does not take it: the batch
    upkeep queues it again."""
    try:
        app.send_task(RUN_BATCH_TASK, args=[batch_id], queue=BATCHES_QUEUE, retry=False, ignore_result=True)
    except (OperationalError, OSError) as exc:
        log.warning("batch %s not queued: the broker did not take it (%s); the batch upkeep will", batch_id, exc)
        return False
    return True
