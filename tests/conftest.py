"""Fixtures shared by all tests: the default model file and real `flotilla run` servers."""

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.infra import EtcdServer, NatsServer, RedisServer
from tests.servers import Server, llama_cpp_available, smollm2_path, start_server


@pytest.fixture(autouse=True)
def _root_logger_put_back() -> Iterator[None]:
    """Undo what a test's in-process ``main()`` did to the root logger (runtime.logging.configure_logging).

    Its handler writes to the stderr pytest captured for that one test, closed once the test ends: left
    on the root logger, a later test's log line (from a thread, say) would fail with "I/O operation on
    closed file". pytest's own handlers are subclasses, and pytest removes them itself.
    """
    root = logging.getLogger()
    handlers, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def echo_full_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("echo_full") / "server.log"
    server = start_server(
        ["out=echo_full", "--model-name", "echo", "--max-body-bytes", "65536"],
        log,
        env={"FLOTILLA_TOKEN_ECHO_DELAY_MS": "0"},
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def echo_core_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("echo_core") / "server.log"
    server = start_server(["out=echo_core", "--context-length", "256"], log, env={"FLOTILLA_TOKEN_ECHO_DELAY_MS": "20"})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llamacpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed (`make install` builds it)")
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    server = start_server(["out=llamacpp", "--context-length", "2048"], log)
    yield server
    server.stop()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh one-member etcd for each test (it starts in ~0.2 s), so a test may restart or wipe it."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream for each test (it starts in ~0.03 s), so a test may restart it."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for each test (Celery's broker), with nothing kept on disk."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()
