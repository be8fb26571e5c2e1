"""The worker's adapter manager (launcher/adapters.py) on a real mocker engine: what it loads, registers,
withdraws and unloads as the --lora flags and the --lora-file say."""

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.engine import MockerEngine
from launcher.adapters import AdapterManager, parse_lora_flag
from runtime.errors import ConfigError
from runtime.lora import LoraAdapter


class Registrations:
    """What the manager registered and withdrew, in order, with the engine's adapters at each step."""

    def __init__(self, engine: MockerEngine) -> None:
        self.engine = engine
        self.log: list[tuple[str, str, bool]] = []  # (action, name, loaded on the engine then)

    async def publish(self, adapter: LoraAdapter) -> None:
        self.log.append(("publish", adapter.name, adapter.name in self.engine.loras))

    async def withdraw(self, name: str) -> None:
        self.log.append(("withdraw", name, name in self.engine.loras))


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    mocker = MockerEngine(MockerConfig(speedup_ratio=0, max_loras=2, lora_load_time=0), vocab_size=100)
    await mocker.start()
    yield mocker
    await mocker.close()


def folder(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def write(path: Path, **adapters: Path) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps({"adapters": [{"name": n, "path": str(p)} for n, p in adapters.items()]}))
    staged.replace(path)


def manager(engine: MockerEngine, registrations: Registrations, **kwargs: object) -> AdapterManager:
    return AdapterManager(engine, publish=registrations.publish, withdraw=registrations.withdraw, **kwargs)  # type: ignore[arg-type]


async def test_adapters_are_loaded_before_registered_and_withdrawn_before_unloaded(
    engine: MockerEngine, tmp_path: Path
) -> None:
    registrations = Registrations(engine)
    lora_file = tmp_path / "adapters.json"
    write(lora_file, a=folder(tmp_path, "a"))
    adapters = manager(engine, registrations, file=lora_file)
    await adapters.start()
    assert engine.loras.keys() == {"a"}
    write(lora_file)
    await adapters.poll()
    assert engine.loras == {}
    assert registrations.log == [("publish", "a", True), ("withdraw", "a", True)]


async def test_a_malformed_file_is_logged_and_keeps_what_is_loaded(
    engine: MockerEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lora_file = tmp_path / "adapters.json"
    write(lora_file, a=folder(tmp_path, "a"))
    adapters = manager(engine, Registrations(engine), file=lora_file)
    await adapters.start()
    lora_file.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        await adapters.poll()
    assert "not an adapter set" in caplog.text and "the adapters loaded stay" in caplog.text
    assert engine.loras.keys() == {"a"}
    lora_file.write_text('{"adapters": [{"name": "bad name!", "path": "/tmp"}]}')
    await adapters.poll()
    assert "is not an adapter name" in caplog.text
    assert engine.loras.keys() == {"a"}


async def test_an_adapter_that_fails_to_load_is_logged_the_others_load_and_it_is_retried_on_the_next_change(
    engine: MockerEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lora_file = tmp_path / "adapters.json"
    a, missing = folder(tmp_path, "a"), tmp_path / "b"
    write(lora_file, b=missing, a=a)
    adapters = manager(engine, Registrations(engine), file=lora_file)
    with caplog.at_level(logging.WARNING):
        await adapters.start()
    assert "LoRA adapter 'b' from" in caplog.text and "failed to load" in caplog.text
    assert engine.loras.keys() == {"a"}
    missing.mkdir()
    write(lora_file, b=missing, a=a)
    await adapters.poll()
    assert engine.loras.keys() == {"a", "b"}


async def test_adapters_past_max_loras_are_logged_and_left_out(
    engine: MockerEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lora_file = tmp_path / "adapters.json"
    write(lora_file, a=folder(tmp_path, "a"), b=folder(tmp_path, "b"), c=folder(tmp_path, "c"))
    adapters = manager(engine, Registrations(engine), file=lora_file)
    with caplog.at_level(logging.WARNING):
        await adapters.start()
    assert engine.loras.keys() == {"a", "b"}
    assert "LoRA adapter 'c' not loaded: the engine holds 2 adapters at most" in caplog.text


async def test_lora_flags_past_max_loras_or_that_fail_to_load_stop_the_start(
    engine: MockerEngine, tmp_path: Path
) -> None:
    three = [LoraAdapter(name=name, path=str(folder(tmp_path, name))) for name in ("a", "b", "c")]
    with pytest.raises(ConfigError, match="--lora gives 3 adapters; the engine holds 2 at most"):
        await manager(engine, Registrations(engine), fixed=three).start()
    gone = LoraAdapter(name="gone", path=str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match=r"--lora gone=.*does not exist"):
        await manager(engine, Registrations(engine), fixed=[gone]).start()


async def test_a_file_adapter_named_as_a_lora_flag_is_ignored(
    engine: MockerEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lora_file = tmp_path / "adapters.json"
    fixed = LoraAdapter(name="a", path=str(folder(tmp_path, "a")))
    write(lora_file, a=folder(tmp_path, "other"))
    with caplog.at_level(logging.WARNING):
        await manager(engine, Registrations(engine), fixed=[fixed], file=lora_file).start()
    assert engine.loras == {"a": Path(fixed.path)}
    assert "is given by --lora too" in caplog.text


def test_a_lora_flag_needs_a_name_and_an_existing_path(tmp_path: Path) -> None:
    assert parse_lora_flag(f"sql={tmp_path}") == LoraAdapter(name="sql", path=str(tmp_path))
    with pytest.raises(ConfigError, match="give NAME=PATH"):
        parse_lora_flag("sql")
    with pytest.raises(ConfigError, match="is not an adapter name"):
        parse_lora_flag(f"-x={tmp_path}")
    with pytest.raises(ConfigError, match="does not exist"):
        parse_lora_flag(f"sql={tmp_path / 'missing'}")
