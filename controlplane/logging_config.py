"""The control plane's logging, from ``FLOTILLA_LOG`` as every Flotilla process reads it (runtime/logging.py).

Django's own default sends a failing request's traceback to the console only when DEBUG is on, and to the
site's admins by email otherwise: with DEBUG off (always, outside development) and no admins, a 500's
traceback went nowhere. Here every record at or over its level goes to stderr (the journal under systemd,
``logs/controlplane.log`` under ``flotilla up``), Django's included, in the format of Flotilla's other
processes. The Celery worker takes the root logger over with its own handler, as Celery does.
"""

import logging
from typing import Any

from runtime.logging import LOG_FORMAT, NOISY_LIBRARIES, parse_log_spec


def logging_settings(spec: str | None) -> dict[str, Any]:
    """Django's ``LOGGING`` (a ``logging.config.dictConfig`` dictionary) for the FLOTILLA_LOG ``spec``. Raises
    ConfigError naming a bad directive."""
    root, targets = parse_log_spec(spec or "info")
    loggers: dict[str, dict[str, Any]] = {
        # Django's records reach the root handler, whatever DEBUG says (its default handlers are dropped).
        "django": {"handlers": [], "level": logging.INFO, "propagate": True},
        # A request's 500 is an error; its 4xx (a wrong token, a missing page) is the client's, which Django logs
        # as a warning each: a scanner or a poll without a token would fill the log.
        "django.request": {"level": logging.ERROR},
        **{name: {"level": max(root, logging.WARNING)} for name in NOISY_LIBRARIES if name not in targets},
        **{name: {"level": level} for name, level in targets.items()},  # FLOTILLA_LOG's say last
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"flotilla": {"format": LOG_FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "flotilla"}},
        "root": {"handlers": ["stderr"], "level": root},
        "loggers": loggers,
    }
