"""Logging set up from ``FLOTILLA_LOG``, in the ``RUST_LOG``-like syntax Dynamo uses.

``FLOTILLA_LOG=info`` sets the root level; ``FLOTILLA_LOG=flotilla.runtime=debug,info`` sets the
logger ``runtime`` (the ``flotilla.`` prefix is optional, our packages are top-level) to debug and
everything else to info. ``-v`` on the command line means debug, ``-vv`` means trace.
"""

import logging
import sys

from runtime.errors import ConfigError

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

#: The format of every Flotilla process's log lines.
LOG_FORMAT = "%(asctime)s %(levelname)-5s %(name)s: %(message)s"
#: Libraries that say too much at info: kept at warning unless FLOTILLA_LOG names them.
NOISY_LIBRARIES = ("httpx", "httpx2", "httpcore", "filelock", "huggingface_hub")

_LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}


def parse_log_spec(spec: str) -> tuple[int, dict[str, int]]:
    """Parse ``"target=level,...,level"`` into (root level, {logger name: level}).

    Raises ConfigError naming the bad directive.
    """
    root = logging.INFO
    targets: dict[str, int] = {}
    for directive in filter(None, (part.strip() for part in spec.split(","))):
        target, _, level_name = directive.rpartition("=")
        level = _LEVELS.get(level_name.strip().lower())
        if level is None:
            raise ConfigError(
                f"FLOTILLA_LOG directive {directive!r}: unknown level {level_name!r} (use one of {', '.join(_LEVELS)})"
            )
        if target:
            name = target.strip().replace("::", ".")
            targets[name.removeprefix("flotilla.")] = level
        else:
            root = level
    return root, targets


def configure_logging(spec: str | None, verbosity: int = 0) -> None:
    """Configure the root logger from a FLOTILLA_LOG spec and the count of ``-v`` flags."""
    root, targets = parse_log_spec(spec or "info")
    if verbosity >= 2:
        root = min(root, TRACE)
    elif verbosity == 1:
        root = min(root, logging.DEBUG)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=root, handlers=[handler], force=True)
    for name, level in targets.items():
        logging.getLogger(name).setLevel(level)
    # Third-party chatter stays at warning unless asked for by name.
    for noisy in NOISY_LIBRARIES:
        if noisy not in targets:
            logging.getLogger(noisy).setLevel(max(root, logging.WARNING))
