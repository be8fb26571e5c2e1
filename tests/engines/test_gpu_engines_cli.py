"""``flotilla run out=sglang`` / ``out=trtllm`` on a node without the library (this one), in a subprocess as a
person runs it: one line naming the extra, exit 2; the GPU flags; the arguments checked before the model."""

import subprocess
import sys
from pathlib import Path

import pytest

from engines.shared.gpu_engine_args import GpuPlacement
from launcher.cli import parse_run_options
from launcher.options import RunOptions
from launcher.run import build_model
from launcher.run_parser import build_run_parser
from runtime.errors import ConfigError

EXTRAS = {"sglang": "sglang", "trtllm": "tensorrt_llm"}


def fake_installed(package: str) -> str:
    """A prelude that makes ``package`` look installed to find_spec (never imported for real)."""
    return (
        "import importlib.machinery, sys, types\n"
        f"module = types.ModuleType({package!r}); module.__spec__ = importlib.machinery.ModuleSpec({package!r}, None)\n"
        f"sys.modules[{package!r}] = module\n"
    )


def run_flotilla(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom launcher.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "run", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_a_node_without_the_library_says_which_extra_to_install_in_one_line(engine: str, tmp_path: Path) -> None:
    result = run_flotilla(f"out={engine}", str(tmp_path), prelude=f"import sys; sys.modules[{EXTRAS[engine]!r}] = None")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"flotilla: out={engine} needs the {EXTRAS[engine]} package (and a CUDA GPU): pip install 'flotilla[{engine}]'"
    ]


@pytest.mark.parametrize(("engine", "raw"), [("sglang", '{"page_size": 16, "bogus": 1}'), ("trtllm", '{"bogus": 1}')])
def test_an_unknown_engine_argument_is_refused_naming_it_before_the_model_loads(
    engine: str, raw: str, tmp_path: Path
) -> None:
    result = run_flotilla(
        f"out={engine}", str(tmp_path / "absent"), "--extra-engine-args", raw, prelude=fake_installed(EXTRAS[engine])
    )
    assert result.returncode == 2, result.stderr
    assert f"unknown key 'bogus' for out={engine}" in result.stderr
    assert "Traceback" not in result.stderr


def test_engines_on_this_node_lists_a_gpu_engine_only_where_its_library_is_installed() -> None:
    listing = (
        "from runtime.fleet_contract.engine_names import engines_on_this_node; print(sorted(engines_on_this_node()))"
    )
    absent = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['sglang'] = sys.modules['tensorrt_llm'] = None\n" + listing],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "sglang" not in absent.stdout and "trtllm" not in absent.stdout
    present = subprocess.run(
        [sys.executable, "-c", fake_installed("sglang") + fake_installed("tensorrt_llm") + listing],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "'sglang'" in present.stdout and "'trtllm'" in present.stdout


def options(*args: str) -> RunOptions:
    parser = build_run_parser()
    return parse_run_options(parser, parser.parse_intermixed_args(list(args)))


def test_the_gpu_flags_reach_the_options_of_a_gpu_engine() -> None:
    given = options(
        "out=sglang", "--tensor-parallel-size", "2", "--base-gpu-id", "1", "--gpu-memory-utilization", "0.3"
    )
    assert (given.tensor_parallel_size, given.base_gpu_id, given.gpu_memory_utilization) == (2, 1, 0.3)


def test_the_gpu_flags_are_refused_for_a_cpu_engine() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", "out=llamacpp", "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "--tensor-parallel-size places a GPU engine (out=sglang, out=trtllm, out=vllm)" in result.stderr


def test_a_gpu_engine_refuses_a_model_that_is_not_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import launcher.run

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(launcher.run, "load_card", lambda options: (None, gguf))
    with pytest.raises(ConfigError, match="out=trtllm loads a Hugging Face folder"):
        build_model(options("out=trtllm", str(gguf)))


def test_both_engines_are_token_engines_that_report_their_kv_cache() -> None:
    from engines.sglang.engine import SglangEngine
    from engines.trtllm.engine import TrtLlmEngine
    from runtime.engine import TokenEngine
    from runtime.kv.events import KvEventSource

    for engine in (SglangEngine(Path("/m"), GpuPlacement(), {}), TrtLlmEngine(Path("/m"), GpuPlacement(), {})):
        assert isinstance(engine, TokenEngine) and isinstance(engine, KvEventSource)
