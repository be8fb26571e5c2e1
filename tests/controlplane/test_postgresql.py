"""The control-plane tests whose behaviour depends on the database, again on PostgreSQL.

Those tests are marked ``postgresql``: races between two connections, conditional updates, transactions
rolled back or committed (and what is announced after commit), the database's clock, the migrations
(pytest-django applies them all to the new database). The rest of tests/controlplane asks nothing of the
database that SQLite and PostgreSQL answer differently, so it runs once, on SQLite.

The outer test starts a throwaway PostgreSQL and runs the marked tests in a child pytest with DATABASE_URL
pointing at it (pytest-django creates its test database there); in the child, the outer test skips itself
and the inner one checks that the database really is PostgreSQL.
"""

import os
import subprocess
import sys

import pytest
from django.db import connection

from tests.controlplane import postgres

MARK = "postgresql"  # the marker of the tests that run again there
RUN_TIMEOUT = 600  # a guard against a hang, not a speed check


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="this run is already on DATABASE_URL")
@pytest.mark.skipif(not postgres.available(), reason="PostgreSQL 15 is not installed (make system-deps installs it)")
def test_the_database_dependent_control_plane_tests_pass_on_postgresql() -> None:
    with postgres.PostgresServer() as server:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", MARK, "tests/controlplane"],
            env=os.environ | {"DATABASE_URL": server.url},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
    # The marked tests ran there, not only the check that the database is PostgreSQL.
    assert int(result.stdout.rsplit(" passed", 1)[0].split()[-1]) > 10, result.stdout[-2000:]


@pytest.mark.django_db
@pytest.mark.postgresql
@pytest.mark.skipif(not os.environ.get("DATABASE_URL", "").startswith("postgres"), reason="runs on PostgreSQL only")
def test_this_run_uses_postgresql() -> None:
    assert connection.vendor == "postgresql"
