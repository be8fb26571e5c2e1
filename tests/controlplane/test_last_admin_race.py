"""Two admins demoting each other at once, on two real database connections (PostgreSQL: SQLite's single
writer hides the race): the second waits for the first's lock on the admins' rows, then finds itself the
last admin and is refused, so the fleet keeps one."""

import contextlib
import os
import threading

import pytest
from django.db import connection

from controlplane.accounts import actions
from controlplane.accounts.models import Role, User
from controlplane.audit.records import Actor
from controlplane.errors import Conflict
from tests.controlplane.factories import make_user

pytestmark = [
    pytest.mark.postgresql,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not os.environ.get("DATABASE_URL", "").startswith("postgres"),
        reason="two connections racing need PostgreSQL (tests/controlplane/test_postgresql.py runs this there)",
    ),
]


@pytest.fixture
def reads_meet(monkeypatch: pytest.MonkeyPatch) -> threading.Barrier:
    """Each change, once it has read its person's row, waits (up to 3 s) for the other to have read too:
    without the lock on the admins' rows both then see another admin; with it, the second reads after the
    first has committed."""
    barrier = threading.Barrier(2, timeout=3)
    locked = actions._locked

    def lock_then_meet(user: User) -> User:
        found = locked(user)
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
        return found

    monkeypatch.setattr(actions, "_locked", lock_then_meet)
    return barrier


@pytest.mark.parametrize("change", ["demote", "deactivate"])
def test_two_admins_stepping_each_other_down_at_once_leave_one_admin(
    reads_meet: threading.Barrier, change: str
) -> None:
    ann, bob = make_user("ann", Role.ADMIN), make_user("bob", Role.ADMIN)
    refused: list[Conflict] = []
    errors: list[BaseException] = []

    def step_down(actor: User, other: User) -> None:
        try:
            if change == "demote":
                actions.update_user(Actor.person(actor), other, role=Role.OPERATOR)
            else:
                actions.deactivate_user(Actor.person(actor), other)
        except Conflict as exc:
            refused.append(exc)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
        finally:
            connection.close()  # each thread has its own connection

    threads = [threading.Thread(target=step_down, args=pair) for pair in ((ann, bob), (bob, ann))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert not errors, errors
    assert len(refused) == 1 and "is the only active admin" in str(refused[0])
    admins = [user.username for user in User.objects.all() if user.is_active and user.role == Role.ADMIN]
    assert len(admins) == 1, admins
