"""Every benchmark docs/benchmarks.md cites, run at its smallest size: a code move that breaks a bench fails here.

Each smoke run starts ``bench/NAME.py`` (or the shell script) as a subprocess from the repository root, as the
docs run it, with arguments that make it finish in seconds, and asserts that it exits 0 and prints the result
line it exists for (a ratio, a table row, a floor's verdict): a bench that runs but measures nothing fails too.
The numbers themselves are not checked: at these sizes, on a shared machine, they mean nothing. The raw
numbers go to a temporary folder (``FLOTILLA_BENCH_RESULTS``), so a real run's bench/results/ is left alone.

Where a bench needs what this machine may lack, the run is skipped, saying what is missing, after the checks
that need nothing: the script parses (``--help`` exits 0, ``bash -n``) and its imports resolve.

* The Dynamo arm of a side-by-side bench needs NVIDIA Dynamo's venv (``make dynamo``: .dynamo-venv, or
  ``DYNAMO_PYTHON``); Flotilla's arm runs without it (``--stacks flotilla``, ``--modes flotilla-kv``).
* bench/sched_latency.sh needs ``perf`` allowed to record scheduler events (root, or
  kernel.perf_event_paranoid <= -1).
* bench/gpu_engines_check.sh, bench/vllm_vs_server.py and bench/sglang_vs_server.py need a CUDA GPU, their
  engine's package and a Hugging Face model folder: never run here.

bench/bare_relay.py, bench/loadgen.py and bench/stacks.py, which the docs cite as parts of other benches,
are run by those benches (gateway_overhead; the mocker stacks of idle_latency, burst_ttft, stack_vs_dynamo,
disagg_vs_dynamo and trace_replay).
"""

import contextlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
#: The runs that judge a floor (exit 1 below it) or load both cores with an engine run alone, after the
#: parallel part of `make test`; the others print ratios that a busy neighbour cannot fail.
SERIAL = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
DOCS = ROOT / "docs" / "benchmarks.md"
#: Cited by the docs as parts of the benches that run them, not run on their own.
PARTS = {"bare_relay.py", "loadgen.py", "stacks.py"}
#: Seconds a bench has after SIGINT (its servers stopped in its ``finally`` blocks) before it is killed.
GRACE_S = 20.0
DYNAMO_PYTHON = Path(os.environ.get("DYNAMO_PYTHON") or ROOT / ".dynamo-venv" / "bin" / "python")


def no_dynamo() -> str | None:
    if DYNAMO_PYTHON.exists():
        return None
    return f"the Dynamo arm needs NVIDIA Dynamo: no {DYNAMO_PYTHON} (`make dynamo` builds .dynamo-venv)"


def no_llama_cpp() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (`make install`)"
    return None


def no_mistralrs() -> str | None:
    if importlib.util.find_spec("mistralrs") is None:
        return "mistralrs is not installed (`make install`)"
    return None


def no_perf(tmp_path: Path) -> str | None:
    """Why ``perf sched record`` cannot run here, or None when a probe of it succeeds."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian's linux-perf package)"
    probe = subprocess.run(
        ["perf", "sched", "record", "-a", "-o", str(tmp_path / "probe.data"), "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0:
        return (
            "perf may not record scheduler events here (it needs root or kernel.perf_event_paranoid <= -1): "
            + probe.stderr.strip()[-300:]
        )
    return None


def no_gpu_run(*packages: str) -> str:
    """Why a GPU bench is not run: what this machine lacks of what it needs."""
    missing = []
    if shutil.which("nvidia-smi") is None:
        missing.append("a CUDA GPU (no nvidia-smi here)")
    if absent := [package for package in packages if importlib.util.find_spec(package) is None]:
        missing.append(f"{' or '.join(absent)} (not installed in {sys.prefix})")
    if "vllm" in packages:
        missing.append("vLLM's CPU build (`make vllm`) takes over a minute to start each server")
    missing.append("a Hugging Face model folder to load (an argument, no default)")
    return "needs " + "; ".join(missing) + ": run it by hand on a GPU machine, as docs/benchmarks.md does"


@dataclass(frozen=True)
class Smoke:
    """One smoke run: ``bench/<script> <args>`` (split as a shell would), whose output must match each of
    ``expect`` (multiline regular expressions) within ``timeout`` seconds; skipped when ``skip`` gives a reason."""

    name: str
    script: str
    args: str
    expect: Sequence[str]
    timeout: float = 60.0
    skip: Callable[[], str | None] | None = None
    marks: Sequence[pytest.MarkDecorator] = ()

    def param(self) -> object:
        reason = self.skip() if self.skip else None
        marks = [*self.marks, *([pytest.mark.skip(reason=reason)] if reason else [])]
        return pytest.param(self, id=self.name, marks=marks)


NUMBER = r"-?[0-9]+(?:\.[0-9]+)?"

SMOKES = [
    Smoke(
        "api_keys_cost",
        "api_keys_cost.py",
        "--seconds 0.5 --rounds 1 --concurrency 2 --workers 1 --tokens 4 --keys 10",
        [rf"^CPU per request, keys \+ limits on / off, median of the rounds: {NUMBER}x", r"^on, 10 keys churned "],
    ),
    Smoke(
        "api_automation",
        "api_automation.py",
        "--duration-s 4 --rate 5",
        [
            rf"^  latency of the well-formed calls: p50 {NUMBER} ms, p99 {NUMBER} ms",
            r"^  change notices dropped: \d+",
            r"^floor \(issue 39: .*\): met$",
        ],
        timeout=300,
        marks=[SERIAL],
    ),
    Smoke(
        "batch_api",
        "batch_api.py",
        "--requests 24 --rounds 1 --concurrency 4 --replicas 1",
        [
            rf"^round 1: direct {NUMBER} s, batch {NUMBER} s \(upload {NUMBER} ms\), batch / direct {NUMBER}x$",
            rf"^24 requests at concurrency 4, batch / direct, median of the rounds: {NUMBER}x$",
        ],
        timeout=240,
    ),
    Smoke(
        "tokenize_latency",
        "tokenize_latency.py",
        "--requests 20 --tokens 100",
        [rf"^  tokenize   p50 {NUMBER} ms, p99 {NUMBER} ms \(less the baseline's p50: {NUMBER} / {NUMBER} ms\)$"],
    ),
    Smoke(
        "burst_ttft",
        "burst_ttft.py",
        "--sizes 2 --tokens 64 --rounds 1 --stacks flotilla",
        [r"^burst of 2, round 1:$", r"^  model\s+\d+\s+\d+$", r"^  flotilla\s+\d+\s+\d+$"],
    ),
    Smoke(
        "burst_ttft-dynamo",
        "burst_ttft.py",
        "--sizes 2 --tokens 64 --rounds 1",
        [r"^  flotilla\s+\d+\s+\d+$", r"^  dynamo\s+\d+\s+\d+$"],
        timeout=180,
        skip=no_dynamo,
    ),
    Smoke(
        "controlplane_api",
        "controlplane_api.py",
        "--duration 2 --baseline 1 --nodes 4 --interval 1 --gpus 1",
        [
            r"^ready in .* s: 4 nodes, 4 pipelines$",
            rf"^operator p99 heartbeating / no heartbeats: {NUMBER}x",
            r"^floor \(operator p99 <= 100 ms under the heartbeats, no errors\): ",
        ],
        marks=[SERIAL],
    ),
    Smoke(
        "dashboard_latency",
        "dashboard_latency.py",
        "--instances 2 --seconds 1 --warmup 0",
        [
            rf"NATS publish -> DOM update\s+n=[1-9]\d*\s+p50\s+{NUMBER} ms\s+p99\s+{NUMBER} ms",
            rf"ratio: p50 {NUMBER}x the echo round trip, p99 {NUMBER}x",
            r"floor p99 <= 500 ms: met",
        ],
        timeout=120,
        marks=[SERIAL],
    ),
    Smoke(
        "event_loop_costs",
        "event_loop_costs.py",
        "--repeat 1",
        [
            rf"^on a thread, loop stall: Tokenizer\.from_str\s+{NUMBER}",
            rf"^tokenize: long chat, 40 turns .*\s{NUMBER}$",
        ],
    ),
    Smoke(
        "fleet_scale",
        "fleet_scale.py",
        "--rounds 1",
        [rf"call -> 4 answering via gateway\s+median\s+{NUMBER} s", r"^floor: 4 ready <= .* s after the call: met$"],
        timeout=120,
        marks=[SERIAL],
    ),
    Smoke(
        "planner_ramp",
        "planner_ramp.py",
        "--ramp-s 8 --interval 1 --sweep-s 1 --sweep-points 1 --isl 512",
        [
            r"^worker-seconds .* static for the peak .*: (met|NOT met)$",
            r"^changes of direction in the steady parts: .*: (met|NOT met)$",
        ],
        timeout=150,
        marks=[SERIAL],
    ),
    Smoke(
        "planner_sim",
        "planner_sim.py",
        "--seeds 2 --trend-gains 0.3/0.1",
        [
            rf"^the bench's settings +{NUMBER} +\[{NUMBER} \.\. {NUMBER}\] +{NUMBER} s +\(max {NUMBER} s\)$",
            rf"^trend 0.3/0.1 +{NUMBER} ",
            rf"^oracle \(the offered rate\) +{NUMBER} ",
        ],
    ),
    Smoke(
        "worker_start",
        "worker_start.py",
        "--rounds 1",
        [rf"^current tree: worker start to banner, median {NUMBER} s \(min {NUMBER}, max {NUMBER}, 1 starts\)$"],
    ),
    Smoke(
        "frozen_worker-stop",
        "frozen_worker.py",
        "--fault stop --streams 5 --silence 1 --give-up 30",
        [rf"broken: 5 of 5 \(StreamBroken\), p50 {NUMBER} s, last {NUMBER} s after the fault"],
    ),
    Smoke(
        "frozen_worker-stuck",
        "frozen_worker.py",
        "--fault stuck --streams 5 --silence 1 --deadline 2 --give-up 30",
        [rf"broken: 5 of 5 \(StreamStalled\), p50 {NUMBER} s, last {NUMBER} s after the fault"],
    ),
    Smoke(
        "gateway_overhead",
        "gateway_overhead.py",
        "--seconds 0.5 --concurrency 2 --rounds 1",
        [rf"^CPU µs per request\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", r"^floors: CPU per request .* µs <= 250: "],
    ),
    Smoke(
        "idle_latency",
        "idle_latency.py",
        "--requests 3 --warmup 1 --rounds 1 --short 16 --long 256 --stacks flotilla",
        [rf"^flotilla\s+16\s+{NUMBER}\s+{NUMBER}\s+2$", rf"^flotilla\s+256\s+{NUMBER}\s+{NUMBER}\s+2$"],
    ),
    Smoke(
        "idle_latency-dynamo",
        "idle_latency.py",
        "--requests 3 --warmup 1 --rounds 1 --short 16 --long 256",
        [
            rf"^Flotilla / Dynamo TTFT p50 at 16 tokens: {NUMBER}$",
            rf"^Flotilla / Dynamo TTFT p50 at 256 tokens: {NUMBER}$",
        ],
        timeout=180,
        skip=no_dynamo,
    ),
    Smoke(
        "kv_router_cost",
        "kv_router_cost.py",
        "--repeat 1 --iterations 10",
        [rf"^\s+8192\s+4\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$"],
    ),
    Smoke(
        "llamacpp_step_cost",
        "llamacpp_step_cost.py",
        "--rows 2 --blocks 1 --requantize q8_0",
        [
            rf"^SmolLM2-135M-Instruct\.Q4_1\.gguf: 1 row {NUMBER} ms, 2 rows {NUMBER} ms \({NUMBER}x\); "
            rf"batching's tokens/s ceiling {NUMBER}x$",
            r"^SmolLM2-135M-Instruct\.Q4_1-q8_0\.gguf: 1 row ",
        ],
        skip=no_llama_cpp,
        marks=[SERIAL, pytest.mark.llamacpp],
    ),
    Smoke(
        "llamacpp_vs_server",
        "llamacpp_vs_server.py",
        "--max-tokens 4 --rounds 1 --concurrency 1 --prompts 1",
        [
            rf"^flotilla / llama_cpp\.server: throughput {NUMBER}x, TTFT p50 {NUMBER}x",
            rf"^flotilla / flotilla-serial: throughput {NUMBER}x",
            r"^same text as llama_cpp\.server at temperature 0: [01]/1 prompts$",
        ],
        timeout=180,
        skip=no_llama_cpp,
        marks=[SERIAL, pytest.mark.llamacpp],
    ),
    Smoke(
        "mistralrs_vs_server",
        "mistralrs_vs_server.py",
        "--max-tokens 4 --concurrency 1 --requests 1",
        [rf"^  concurrency 1: throughput {NUMBER}x, TTFT p50 {NUMBER}x"],
        timeout=120,
        skip=no_mistralrs,
        marks=[SERIAL, pytest.mark.mistralrs],
    ),
    Smoke(
        "mocker_cost",
        "mocker_cost.py",
        "--requests 50 --concurrency 4 --tokens 8",
        [r"^  CPU per request: \d+ µs$", r"^  KV events: \d+, prefix hit rate: "],
    ),
    Smoke(
        "mocker_step_precision",
        "mocker_step_precision.py",
        "--requests 2 --tokens 10 --prompt 64",
        [rf"^timerfd / asyncio\.sleep, median \|gap - step\|: {NUMBER}$"],
    ),
    Smoke(
        "nats_blip",
        "nats_blip.py",
        "--streams 10 --max-tokens 100 --settle 0.5 --repeat 1",
        [r"^  gone_after 1 s \(the probe fix on\): \d+ of 10 ", r"^  gone_after 0 s .*: \d+ of 10 "],
    ),
    Smoke(
        "nats_consume",
        "nats_consume.py",
        "--messages 500 --repeat 1",
        [rf"^  consume / iterator: {NUMBER}x$"],
    ),
    Smoke(
        "network_path",
        "network_path.py",
        "--seconds 0.5 --concurrency 2 --rounds 1 --workers 1 --tokens 4",
        [rf"^network / single process: {NUMBER}x requests/s", rf"^ingress CPU per request: {NUMBER} ms"],
    ),
    Smoke(
        "overload",
        "overload.py",
        "--levels 20 --tokens 8 --delay-ms 1 --workers 1 --timeout 60",
        [r"^\s+20\s+20\s+0\s+0\s"],  # streams, completed, refused, failed
    ),
    Smoke(
        "request_plane_cost",
        "request_plane_cost.py",
        "--streams 4 --tokens 20 --rounds 1",
        [rf"^  the request plane's own: {NUMBER} µs per token$"],
    ),
    Smoke(
        "routing_sim",
        "routing_sim.py",
        "--duration 2 --seeds 2 --weights 1 --queued-prefill-weights 0.5 --replicas 1,2",
        [rf"^\s+1\s+0\.5\s+2\s+on\s+100\s+{NUMBER}\s+{NUMBER}\s"],  # the 2-router row, synced
    ),
    Smoke(
        "stack_vs_dynamo",
        "stack_vs_dynamo.py",
        "--seconds 0.5 --warmup 0.2 --rounds 1 --concurrency 2 --tokens 4 --stacks flotilla",
        [rf"^flotilla\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}", r"paced at .* requests/s"],
    ),
    Smoke(
        "stack_vs_dynamo-dynamo",
        "stack_vs_dynamo.py",
        "--seconds 0.5 --warmup 0.2 --rounds 1 --concurrency 2 --tokens 4",
        [rf"^Flotilla / Dynamo: requests/s {NUMBER}x", rf"^Flotilla / Dynamo at .* requests/s: TTFT p50 {NUMBER}x"],
        timeout=240,
        skip=no_dynamo,
    ),
    Smoke(
        "gpu_disagg_stack_check",
        "gpu_disagg_stack_check.py",
        "--engine mocker",
        [
            r"^PASS disagg-stack remote: prefilled by \w+, decoded by \w+",
            r"^PASS disagg-stack token-exact: ",
            r"^PASS disagg-stack handoff: the prefill worker computed 1 prompt\(s\) .* took 1 handoff\(s\)",
        ],
        timeout=120,
    ),
    Smoke(
        "disagg_vs_dynamo",
        "disagg_vs_dynamo.py",
        "--requests 4 --concurrency 2 --tokens 64 --max-tokens 4 --rounds 1 --stacks flotilla",
        [
            rf"^flotilla 1P\+1D conditional\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$",
            rf"^conditional / flotilla 2 aggregated: TTFT p50 {NUMBER}x",
        ],
        timeout=120,
    ),
    Smoke(
        "disagg_vs_dynamo-dynamo",
        "disagg_vs_dynamo.py",
        "--requests 4 --concurrency 2 --tokens 64 --max-tokens 4 --rounds 1",
        [
            rf"^plain 1P\+1D / dynamo plain: TTFT p50 {NUMBER}x",
            rf"^conditional / dynamo prefill_load: TTFT p50 {NUMBER}x",
        ],
        timeout=240,
        skip=no_dynamo,
    ),
    Smoke(
        "kv_tiers_vs_dynamo",
        "kv_tiers_vs_dynamo.py",
        "--documents 3 --document-tokens 256 --requests 6 --max-tokens 4 --concurrency 2 --rounds 1 --stacks flotilla",
        [
            rf"^flotilla host tier\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$",
            rf"^flotilla host tier / device only: TTFT p50 {NUMBER}x",
        ],
        timeout=120,
    ),
    Smoke(
        "kv_tiers_vs_dynamo-dynamo",
        "kv_tiers_vs_dynamo.py",
        "--documents 3 --document-tokens 256 --requests 6 --max-tokens 4 --concurrency 2 --rounds 1",
        [rf"^flotilla host tier / dynamo host tier: TTFT p50 {NUMBER}x, p99 {NUMBER}x"],
        timeout=240,
        skip=no_dynamo,
    ),
    Smoke(
        "kv_tiers_sim",
        "kv_tiers_sim.py",
        "--documents 4 --document-tokens 512 --requests 12 --max-tokens 4 --seeds 2 --draws 1",
        [rf"^host tier\s+seed 2 x1 draw 0\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s"],
    ),
    Smoke(
        "trace_replay",
        "trace_replay.py",
        "--modes flotilla-kv --duration 2 --rate 8 --warmup 0",
        [r"^\[1/1\] flotilla-kv: \d+ done, 0 failed, TTFT p50 ", rf"^  kv hit rate / ideal: {NUMBER} "],
    ),
    Smoke(
        "trace_replay-dynamo",
        "trace_replay.py",
        "--modes flotilla-kv,dynamo-kv --duration 2 --rate 8 --warmup 0",
        [r"^\[2/2\] dynamo-kv: \d+ done, 0 failed, ", rf"^  Flotilla kv / Dynamo kv TTFT p50: {NUMBER}"],
        timeout=180,
        skip=no_dynamo,
    ),
    Smoke(
        "zombie_streams",
        "zombie_streams.py",
        "--streams 10 --deadline 1 --settle 0.5",
        [
            rf"^  generated for nobody after the kill: \d+ tokens .*: {NUMBER} of it$",
            r"^  streams stopped after the kill: 10 of 10 ",
        ],
    ),
]


def run_bench(command: Sequence[str], timeout: float, env: dict[str, str]) -> tuple[int, str, float]:
    """Run ``command`` from the repository root; returns its exit code, its output (stdout and stderr
    together) and its seconds. Past ``timeout`` it gets SIGINT, so that it stops the servers it started,
    then SIGKILL, and the test fails. What is left of its process group once it has exited (servers it
    started without a session of their own and did not stop) is killed."""
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} ran past {timeout:g} s; its output:\n{output[-6000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output, time.monotonic() - started


def bench_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "FLOTILLA_BENCH_RESULTS": str(tmp_path / "results"), **(extra or {})}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [case.param() for case in SMOKES])
def test_bench_runs_at_its_smallest_size(case: Smoke, tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH / case.script), *shlex.split(case.args)]
    code, output, seconds = run_bench(command, case.timeout, bench_env(tmp_path))
    shown = f"bench/{case.script} {case.args} (exit {code}, {seconds:.1f} s):\n{output[-6000:]}"
    assert code == 0, shown
    for pattern in case.expect:
        assert re.search(pattern, output, re.MULTILINE), f"no line matches {pattern!r} in the output of {shown}"


@pytest.mark.timeout(180)
def test_sched_latency_sh(tmp_path: Path) -> None:
    """The shell script parses; with perf, it records a second of a short replay through one ingress."""
    script = BENCH / "sched_latency.sh"
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert parsed.returncode == 0, parsed.stderr
    if reason := no_perf(tmp_path):
        pytest.skip(reason)
    env = bench_env(
        tmp_path,
        {
            "PYTHON": sys.executable,
            "RECORD_AFTER_S": "0",
            "RECORD_S": "1",
            "REPLAY_ARGS": "--duration 4 --rate 8 --warmup 0",
        },
    )
    code, output, seconds = run_bench([str(script), "1"], 120, env)
    shown = f"bench/sched_latency.sh 1 (exit {code}, {seconds:.1f} s):\n{output[-6000:]}"
    assert code == 0, shown
    assert re.search(r"^through 1 ingress process\(es\), 1 s of the trace:$", output, re.MULTILINE), shown
    assert re.search(r"^\s+Task\s+\|\s+Runtime ms", output, re.MULTILINE), shown
    assert re.search(r"^\[1/1\] flotilla-kv: \d+ done, 0 failed", output, re.MULTILINE), shown


@pytest.mark.parametrize("script", ["vllm_vs_server.py", "sglang_vs_server.py"])
def test_gpu_bench_parses_and_imports(script: str) -> None:
    """``--help`` runs the script's imports (its engine's package is imported only to measure)."""
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"usage: {script} "), done.stdout
    pytest.skip(no_gpu_run("vllm" if script.startswith("vllm") else "sglang"))


def test_gpu_engines_check_sh_parses_and_imports(tmp_path: Path) -> None:
    """bench/gpu_engines_check.sh parses, the checks it runs in the engine's process import, and the script
    reports SKIP for every engine whose package is missing here."""
    script = BENCH / "gpu_engines_check.sh"
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert parsed.returncode == 0, parsed.stderr
    text = script.read_text()
    # The in-process check, the KV offloading check that restarts the engine, SGLang's own checks (min_tokens,
    # a cancel in prefill, SIGTERM, guided JSON, logprobs, the settled page size) and the LoRA adapters' (load and
    # unload under load, answers, KV events).
    embedded = re.findall(r"<<'PY'\n(.*?)\nPY\n", text, re.DOTALL)
    assert len(embedded) == 4, "the in-process checks (<<'PY' here-documents) are no longer in gpu_engines_check.sh"
    for number, source in enumerate(embedded):
        check = tmp_path / f"check{number}.py"
        check.write_text(source)
        loaded = subprocess.run(
            [sys.executable, "-c", f"import runpy; runpy.run_path({str(check)!r}, run_name='smoke')"],
            cwd=ROOT,
            env={**os.environ, "ENGINE": "vllm", "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=False,
        )
        assert loaded.returncode == 0, loaded.stderr
    packages = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}
    missing = [engine for engine, package in packages.items() if importlib.util.find_spec(package) is None]
    if missing:
        venv = Path(sys.executable).parent.parent
        done = subprocess.run(
            [str(script), str(tmp_path / "no-model"), *missing],
            env={**os.environ, "VENV": str(venv)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        for engine in missing:
            assert f"SKIP {engine} install: the {packages[engine]} package is not installed" in done.stdout, done.stdout
    pytest.skip(no_gpu_run(*packages.values()))


def test_every_cited_bench_is_smoke_run() -> None:
    """Each script docs/benchmarks.md cites is smoke-run here (or is a part that others run)."""
    cited = set(re.findall(r"(?<![\w/])bench/([a-z_]+\.(?:py|sh))", DOCS.read_text()))
    assert cited, "docs/benchmarks.md cites no bench/ script"
    covered = {case.script for case in SMOKES}
    covered |= {"sched_latency.sh", "gpu_engines_check.sh", "vllm_vs_server.py", "sglang_vs_server.py"}
    assert cited - PARTS - covered == set(), "cited in docs/benchmarks.md but not smoke-run here"
    assert {name for name in cited | covered | PARTS if not (BENCH / name).exists()} == set(), "not in bench/"
