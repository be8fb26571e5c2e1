"""The control-plane tests again, on PostgreSQL: a plain `pytest` covers both databases.

The outer test starts a throwaway PostgreSQL and runs tests/controlplane in a child pytest with
DATABASE_URL pointing at it (pytest-django creates its test database there); in the child, the outer
test skips itself and the inner one checks that the database really is PostgreSQL.
"""

import os
import subprocess
import sys

import pytest
from django.db import connection

from tests.controlplane import postgres

RUN_TIMEOUT = 1200  # a guard against a hang, not a speed check: the suite takes minutes on 2 shared cores


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="this run is already on DATABASE_URL")
@pytest.mark.skipif(not postgres.available(), reason="PostgreSQL 15 is not installed (make system-deps installs it)")
def test_the_control_plane_tests_pass_on_postgresql() -> None:
    with postgres.PostgresServer() as server:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/controlplane"],
            env=os.environ | {"DATABASE_URL": server.url},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.django_db
@pytest.mark.skipif(not os.environ.get("DATABASE_URL", "").startswith("postgres"), reason="runs on PostgreSQL only")
def test_this_run_uses_postgresql() -> None:
    assert connection.vendor == "postgresql"
