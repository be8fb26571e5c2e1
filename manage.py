#!/usr/bin/env python
"""Django's command-line utility for the Flotilla control plane."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    from runtime.errors import ConfigError

    try:
        execute_from_command_line(sys.argv)
    except ConfigError as exc:
        # A bad variable (DATABASE_URL, FLOTILLA_SECRET_KEY, ...) gets one line, not a traceback.
        sys.exit(f"manage.py: {exc}")


if __name__ == "__main__":
    main()
