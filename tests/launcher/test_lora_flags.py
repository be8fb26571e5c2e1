"""`flotilla run --lora NAME=PATH` and `--lora-file FILE`: parsed into the run's options, and every misuse an
exit 2 that says what to fix, never a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import parse_run_options
from launcher.options import RunOptions
from launcher.run_parser import build_run_parser
from runtime.lora import LoraAdapter


def options(*args: str) -> RunOptions:
    parser = build_run_parser()
    return parse_run_options(parser, parser.parse_intermixed_args(list(args)))


def flotilla_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_lora_flags_repeat_and_add_to_the_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("FLOTILLA_LORA", f"a={tmp_path / 'a'}")
    parsed = options("in=dyn://llm", "out=mocker", "--lora", f"b={tmp_path / 'b'}", "--lora-file", "x.json")
    assert parsed.loras == (
        LoraAdapter(name="a", path=str(tmp_path / "a")),
        LoraAdapter(name="b", path=str(tmp_path / "b")),
    )
    assert parsed.lora_file == Path("x.json")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("out=echo_full", "--lora", "{a}"), "out=echo_full does not load LoRA adapters; engines that do"),
        (("out=mocker", "--lora", "bad name={folder}"), "is not an adapter name"),
        (("out=mocker", "--lora", "sql={folder}/missing"), "does not exist"),
        (("out=mocker", "--lora", "sql"), "give NAME=PATH"),
        (("out=mocker", "--lora", "{a}", "--lora", "{a}"), "adapter 'sql' is given twice"),
    ],
)
def test_a_bad_lora_flag_exits_2_saying_what_is_wrong(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    given = [arg.format(a=f"sql={tmp_path}", folder=tmp_path) for arg in args]
    result = flotilla_run("in=dyn://llm", *given)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_adapters_outside_a_worker_or_in_http_exit_2(tmp_path: Path) -> None:
    result = flotilla_run("in=text", "out=mocker", "--lora", f"sql={tmp_path}")
    assert result.returncode == 2
    assert "adapters are served by a worker (in=dyn://...) or in=http, not in=text" in result.stderr


def test_more_lora_flags_than_the_engine_holds_exit_2(tmp_path: Path) -> None:
    """The engine's max_loras is known once it is built: the worker stops before it serves anything."""
    settings = tmp_path / "mocker.json"
    settings.write_text('{"max_loras": 1, "speedup_ratio": 0}')
    result = flotilla_run(
        "in=dyn://llm", "out=mocker", "--extra-engine-args", str(settings),
        "--lora", f"a={tmp_path}", "--lora", f"b={tmp_path}",
        env={"ETCD_ENDPOINTS": "http://127.0.0.1:1", "NATS_SERVER": "nats://127.0.0.1:1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--lora gives 2 adapters; the engine holds 1 at most" in result.stderr
