"""The alerts' settings, read from the environment each pass (``FLOTILLA_ALERT_*``; docs/controlplane.md).

Read when used rather than at import, so that a changed environment (a test, a restarted worker) is seen;
a malformed value raises ConfigError naming the variable.
"""

from dataclasses import dataclass

from runtime.config import env_float, env_int, env_list, env_str
from runtime.errors import ConfigError


@dataclass(frozen=True)
class AlertSettings:
    every_s: float = 15.0  # FLOTILLA_ALERT_EVERY_S: how often the rules are evaluated (Celery beat)
    crash_restarts: int = 3  # FLOTILLA_ALERT_CRASH_RESTARTS: restarts within the window that make a crash loop
    crash_window_s: float = 600.0  # FLOTILLA_ALERT_CRASH_WINDOW_S
    pending_s: float = 120.0  # FLOTILLA_ALERT_PENDING_S: unplaced this long (with a reason) is unschedulable
    renotify_s: float = 0.0  # FLOTILLA_ALERT_RENOTIFY_S: 0 = a firing alert is notified once
    webhook_url: str = ""  # FLOTILLA_ALERT_WEBHOOK_URL
    webhook_secret: str = ""  # FLOTILLA_ALERT_WEBHOOK_SECRET (or _FILE): signs the body (HMAC-SHA256)
    webhook_timeout_s: float = 5.0  # FLOTILLA_ALERT_WEBHOOK_TIMEOUT_S
    emails: tuple[str, ...] = ()  # FLOTILLA_ALERT_EMAILS: comma-separated; sent only where EMAIL_HOST is set
    keep_s: float = 30 * 24 * 3600.0  # FLOTILLA_ALERT_KEEP_S: resolved alerts and ended silences kept this long

    @classmethod
    def from_env(cls) -> "AlertSettings":
        url = env_str("FLOTILLA_ALERT_WEBHOOK_URL") or ""
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"FLOTILLA_ALERT_WEBHOOK_URL must be an http(s) URL, not {url[:100]!r}")
        emails = tuple(env_list("FLOTILLA_ALERT_EMAILS"))
        for address in emails:
            if "@" not in address:
                raise ConfigError(f"FLOTILLA_ALERT_EMAILS: {address[:100]!r} is not an email address")
        return cls(
            every_s=env_float("FLOTILLA_ALERT_EVERY_S", cls.every_s, minimum=1.0),
            crash_restarts=env_int("FLOTILLA_ALERT_CRASH_RESTARTS", cls.crash_restarts, minimum=1),
            crash_window_s=env_float("FLOTILLA_ALERT_CRASH_WINDOW_S", cls.crash_window_s, minimum=1.0),
            pending_s=env_float("FLOTILLA_ALERT_PENDING_S", cls.pending_s, minimum=0.0),
            renotify_s=env_float("FLOTILLA_ALERT_RENOTIFY_S", cls.renotify_s, minimum=0.0),
            webhook_url=url,
            webhook_secret=env_str("FLOTILLA_ALERT_WEBHOOK_SECRET") or "",
            webhook_timeout_s=env_float("FLOTILLA_ALERT_WEBHOOK_TIMEOUT_S", cls.webhook_timeout_s, minimum=0.1),
            emails=emails,
            keep_s=env_float("FLOTILLA_ALERT_KEEP_S", cls.keep_s, minimum=60.0),
        )
