"""The worker's /metrics serves SGLang's own metrics (``sglang:*``) after its own, as SGLang's server would.

SGLang's scheduler processes write their metrics in prometheus_client's multiprocess mode to the directory that
``sglang.Engine`` put in ``PROMETHEUS_MULTIPROC_DIR`` (``set_prometheus_multiproc_dir``,
python/sglang/srt/utils/common.py; its server reads them with ``MultiProcessCollector`` in
``add_prometheus_middleware``). Here a real second process writes such files, as a scheduler does, and the
engine is the SglangEngine started on the stand-in of tests/engines/test_sglang.py.
"""

import asyncio
import os
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.engines.test_sglang import FakeSglang, start_on_fake

# What a scheduler process does with its metrics (sglang/srt/metrics/collector.py: SchedulerMetricsCollector).
_SCHEDULER = textwrap.dedent(
    """
    from prometheus_client import Counter, Gauge
    Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", ["model_name"]).labels("m").inc(7)
    Gauge("sglang:cache_hit_rate", "The cache hit rate", ["model_name"], multiprocess_mode="mostrecent").labels(
        "m"
    ).set(0.25)
    """
)


def _samples(exposition: bytes) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(exposition.decode())
        for sample in family.samples
    }


async def test_the_worker_metrics_carry_sglangs_own_from_its_processes_and_this_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    scheduler = await asyncio.create_subprocess_exec(sys.executable, "-c", _SCHEDULER, env=env)
    assert await asyncio.wait_for(scheduler.wait(), 60) == 0
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))  # as sglang.Engine leaves it
    # The tokenizer manager's metrics, in this process's registry (prometheus_client imported before SGLang
    # set the directory).
    tokenizer_gauge = Gauge("sglang:num_running_reqs_test", "Running requests (this process).")
    tokenizer_gauge.set(3)
    fake = FakeSglang([])
    engine, _ = await start_on_fake(monkeypatch, fake)
    try:
        assert fake.kwargs["enable_metrics"] is True  # type: ignore[attr-defined]
        registry = engine.prometheus_registry()
        assert registry is not None
        samples = _samples(generate_latest(registry))
        assert samples["sglang:prompt_tokens_total"] == 7.0
        assert samples["sglang:cache_hit_rate"] == 0.25
        assert samples["sglang:num_running_reqs_test"] == 3.0
        # Only SGLang's families of this process's registry: not the Python process's own.
        assert not any(name.startswith("process_") or name.startswith("python_") for name in samples)
    finally:
        REGISTRY.unregister(tokenizer_gauge)
        await engine.close()


async def test_no_sglang_metrics_when_the_worker_turns_them_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    engine, _ = await start_on_fake(monkeypatch, FakeSglang([]), {"enable_metrics": False})
    try:
        assert engine.prometheus_registry() is None
    finally:
        await engine.close()
