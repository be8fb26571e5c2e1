"""The periodic sync of the control plane's etcd records against a real etcd: it never undoes a change published
while it runs (controlplane/etcd_records.py). Found in CI: a sync that read the API keys from the database, then
etcd, deleted a key made and published between the two reads, and the gateway answered that key 401 until the
next sync."""

import pytest

from controlplane.etcd_records import sync_prefix
from tests.distributed.cluster import etcd_put, etcd_values
from tests.infra import EtcdServer

PREFIX = "flotilla/test-records/"


@pytest.fixture
def etcd(etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> EtcdServer:
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    sync_prefix(PREFIX, dict)  # a clean prefix: the etcd server is shared by the session's tests
    return etcd_server


def test_a_record_published_while_the_sync_runs_is_kept(etcd: EtcdServer) -> None:
    etcd_put(etcd, PREFIX + "old", "1")

    def database() -> dict[str, bytes]:
        # Read after etcd: a key made and published now is in the database the sync reads...
        etcd_put(etcd, PREFIX + "new", "2")
        # ...but a database read that came before the publication (as the sync once did it) lacks it.
        return {PREFIX + "old": b"1"}

    report = sync_prefix(PREFIX, database)
    assert etcd_values(etcd, PREFIX) == {PREFIX + "old": "1", PREFIX + "new": "2"}
    assert (report.written, report.deleted) == (0, 0)


def test_a_record_changed_while_the_sync_runs_is_neither_overwritten_nor_deleted(etcd: EtcdServer) -> None:
    etcd_put(etcd, PREFIX + "changed", "v1")
    etcd_put(etcd, PREFIX + "revived", "r1")

    def database() -> dict[str, bytes]:
        etcd_put(etcd, PREFIX + "changed", "v2")  # a newer publication than the database read below
        etcd_put(etcd, PREFIX + "revived", "r2")
        return {PREFIX + "changed": b"v0"}  # stale: "revived" not in it, "changed" at an older value

    report = sync_prefix(PREFIX, database)
    assert etcd_values(etcd, PREFIX) == {PREFIX + "changed": "v2", PREFIX + "revived": "r2"}
    assert sorted(report.raced) == [PREFIX + "changed", PREFIX + "revived"]
    # The next sync, with the database as it is now, converges.
    again = sync_prefix(PREFIX, lambda: {PREFIX + "changed": b"v2"})
    assert (again.deleted, again.raced) == (1, []) and etcd_values(etcd, PREFIX) == {PREFIX + "changed": "v2"}


def test_what_differs_is_written_and_what_is_not_wanted_is_deleted(etcd: EtcdServer) -> None:
    etcd_put(etcd, PREFIX + "a", "stale")
    etcd_put(etcd, PREFIX + "forged", "x")
    report = sync_prefix(PREFIX, lambda: {PREFIX + "a": b"fresh", PREFIX + "b": b"new"})
    assert (report.written, report.deleted, report.unchanged) == (2, 1, 0)
    assert etcd_values(etcd, PREFIX) == {PREFIX + "a": "fresh", PREFIX + "b": "new"}
