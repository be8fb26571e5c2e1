"""From the ingress's histograms and the workers' load reports to an Observation."""

import pytest

from frontend_gateway.metrics import GatewayMetrics
from planner import GroupObservation, PlannerError
from planner.measure import (
    HistogramSnapshot,
    IngressSnapshot,
    check_ingress_exposition,
    counter_rate,
    exposition_by_source,
    histogram_delta,
    histogram_quantile,
    ingress_snapshot,
    ingress_stats,
    observation,
    replica_loads,
)
from runtime.kv.events import WorkerLoad

INF = float("inf")


def snapshot(
    counts: list[float], total: float = 0.0, bounds: tuple[float, ...] = (0.1, 0.5, 1.0, INF)
) -> HistogramSnapshot:
    """Cumulative buckets from per-bucket counts."""
    cumulative, running = [], 0.0
    for count in counts:
        running += count
        cumulative.append(running)
    return HistogramSnapshot(tuple(zip(bounds, cumulative, strict=True)), total)


def test_the_p90_of_an_interval_is_interpolated_inside_its_bucket() -> None:
    # 100 observations: 50 under 0.1 s, 40 in (0.1, 0.5], 10 in (0.5, 1.0]. The 90th is the last of the
    # second bucket: 0.5 s; the 95th is half-way through the third: 0.75 s.
    histogram = snapshot([50, 40, 10, 0])
    assert histogram_quantile(0.90, histogram) == pytest.approx(0.5)
    assert histogram_quantile(0.95, histogram) == pytest.approx(0.75)
    assert histogram_quantile(0.25, histogram) == pytest.approx(0.05)


def test_the_quantile_of_an_interval_uses_only_that_intervals_observations() -> None:
    before = snapshot([1000, 0, 0, 0], total=50.0)  # a fast past
    after = snapshot([1000, 0, 10, 0], total=58.0)  # ten slow requests in this interval
    delta = histogram_delta(before, after)
    assert delta.count == 10
    assert histogram_quantile(0.9, delta) == pytest.approx(0.95)
    assert histogram_quantile(0.9, after) < 0.1  # the lifetime figure would hide them


def test_a_counter_reset_counts_everything_after_it() -> None:
    before = snapshot([500, 500, 0, 0], total=100.0)
    after = snapshot([2, 1, 0, 0], total=0.5)  # the ingress restarted
    assert histogram_delta(before, after) == after
    assert counter_rate(1000.0, 30.0, 10.0) == 3.0
    assert counter_rate(1000.0, 1030.0, 10.0) == 3.0


def test_a_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, snapshot([0, 0, 1, 9])) == 1.0


def test_an_interval_without_observations_has_no_quantile() -> None:
    assert histogram_quantile(0.9, snapshot([0, 0, 0, 0])) is None
    assert histogram_quantile(0.9, HistogramSnapshot(())) is None


def test_snapshots_with_different_buckets_are_refused() -> None:
    with pytest.raises(PlannerError, match="different buckets"):
        histogram_delta(snapshot([1, 0, 0, 0]), snapshot([1, 0, 0], bounds=(0.1, 1.0, INF)))


def test_two_ingresses_histograms_add_up() -> None:
    assert (snapshot([1, 2, 0, 0], 1.0) + snapshot([3, 0, 1, 0], 2.0)) == snapshot([4, 2, 1, 0], 3.0)


def _serve(metrics: GatewayMetrics, requests: int, ttft: float, isl: int, osl: int) -> None:
    model = metrics.for_model("smol")
    for _ in range(requests):
        model.ttft.observe(ttft)
        model.inter_token_latency.observe(0.02)
        model.finished(
            endpoint="chat", streaming=True, status="success", duration=1.0, prompt_tokens=isl, completion_tokens=osl
        )


def test_ingress_stats_come_from_two_expositions_of_the_gateways_metrics() -> None:
    metrics = GatewayMetrics()
    _serve(metrics, 50, ttft=0.03, isl=100, osl=10)
    before = ingress_snapshot(metrics.exposition().decode(), "smol", at_s=100.0)
    _serve(metrics, 90, ttft=0.2, isl=2000, osl=300)
    _serve(metrics, 10, ttft=3.0, isl=2000, osl=300)
    after = ingress_snapshot(metrics.exposition().decode(), "smol", at_s=110.0)
    stats = ingress_stats(before, after, percentile=90)
    assert stats.interval_s == 10.0
    assert stats.request_rate == pytest.approx(10.0)
    assert (stats.mean_isl, stats.mean_osl) == (pytest.approx(2000.0), pytest.approx(300.0))
    assert stats.ttft_s == pytest.approx(0.25)  # the 90th of 100 is the last in the (0.1, 0.25] bucket
    assert stats.itl_s == pytest.approx(0.01 + 0.015 * 0.9)  # all in (0.01, 0.025]: 90% of the way
    assert ingress_snapshot(metrics.exposition().decode(), "other", at_s=0.0) == IngressSnapshot(0.0)


def test_replica_loads_fold_dp_ranks_and_keep_each_ranks_latest_report() -> None:
    reports = [
        WorkerLoad(instance_id=7, dp_rank=0, active_requests=9, kv_active_blocks=90, kv_total_blocks=100),
        WorkerLoad(instance_id=7, dp_rank=0, active_requests=3, waiting=1, kv_active_blocks=30, kv_total_blocks=100),
        WorkerLoad(instance_id=7, dp_rank=1, active_requests=2, waiting=2, kv_active_blocks=10, kv_total_blocks=100),
        WorkerLoad(instance_id=4, active_requests=1, kv_usage=0.5),
    ]
    loads = replica_loads(reports, queued_prefill_tokens={4: 700}, mean_isl=1000.0)
    assert [load.instance_id for load in loads] == [4, 7]
    four, seven = loads
    assert (four.active_requests, four.kv_usage, four.queued_prefill_tokens) == (1, 0.5, 700.0)
    assert (seven.active_requests, seven.kv_usage) == (5, pytest.approx(0.2))
    assert seven.queued_prefill_tokens == 3000.0  # 3 waiting × ISL 1,000, estimated: no router count for it


def test_queued_prompt_tokens_are_unknown_without_a_router_count_or_waiting_requests() -> None:
    (load,) = replica_loads([WorkerLoad(instance_id=1, active_requests=2)], mean_isl=1000.0)
    assert load.queued_prefill_tokens is None


def test_nothing_waiting_is_no_queued_prompt_tokens_even_when_no_request_finished_to_give_an_isl() -> None:
    # An idle interval has no mean ISL; had the queue been unknown then, load mode could never scale down.
    reports = [
        WorkerLoad(instance_id=1, active_requests=0, waiting=0),
        WorkerLoad(instance_id=2, active_requests=3, waiting=2),
    ]
    idle, busy = replica_loads(reports)
    assert idle.queued_prefill_tokens == 0.0
    assert busy.queued_prefill_tokens is None  # two waiting, of a length no one measured


def test_an_observation_carries_the_interval_and_its_groups() -> None:
    metrics = GatewayMetrics()
    before = ingress_snapshot(metrics.exposition().decode(), "smol", at_s=0.0)
    _serve(metrics, 20, ttft=0.03, isl=100, osl=10)
    stats = ingress_stats(before, ingress_snapshot(metrics.exposition().decode(), "smol", at_s=5.0))
    obs = observation(stats, [GroupObservation("aggregated", 1)], prefix_hit_rate=0.3)
    assert (obs.request_rate, obs.percentile, obs.prefix_hit_rate) == (4.0, 90.0, 0.3)
    assert obs.group("aggregated") is not None and obs.group("decode") is None
    with pytest.raises(PlannerError, match="later"):
        ingress_stats(before, before)


def _as_scraped(expositions: dict[str, GatewayMetrics]) -> str:
    """Several ingresses' /metrics as a Prometheus holds them: each series with its ``instance`` label, each
    family's series together (the shape planner.measure.exposition_from_query gives a query's answer)."""
    families: dict[str, list[str]] = {}
    for instance, metrics in expositions.items():
        family = ""
        for line in metrics.exposition().decode().splitlines():
            if line.startswith("# TYPE "):
                family = line
                families.setdefault(family, [])
            elif line.strip() and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                if "{" in name:
                    labelled = name.replace("{", f'{{instance="{instance}",', 1)
                else:
                    labelled = f'{name}{{instance="{instance}"}}'
                families[family].append(f"{labelled} {value}")
    return "".join(f"{family}\n" + "".join(f"{line}\n" for line in lines) for family, lines in families.items())


def test_an_ingress_restarted_among_several_counts_what_it_saw_since_not_what_every_ingress_saw() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    _serve(first, 300, ttft=0.03, isl=100, osl=10)
    _serve(second, 200, ttft=0.03, isl=100, osl=10)
    before = ingress_snapshot(_as_scraped({"a:8080": first, "b:8080": second}), "smol", at_s=0.0)
    assert before.input_tokens.count == 500  # the sum, as before
    # Over 10 s: the first serves 30 more; the second restarts (its counters from zero) and serves 20.
    _serve(first, 30, ttft=0.03, isl=100, osl=10)
    restarted = GatewayMetrics()
    _serve(restarted, 20, ttft=0.03, isl=100, osl=10)
    after = ingress_snapshot(_as_scraped({"a:8080": first, "b:8080": restarted}), "smol", at_s=10.0)
    stats = ingress_stats(before, after)
    # 50 requests in 10 s. Summed, the counters went down (530 -> 350) and all 350 would have been taken as new.
    assert stats.request_rate == pytest.approx(5.0)
    assert stats.mean_isl == pytest.approx(100.0)


def test_an_ingress_first_seen_gives_its_baseline_and_counts_from_the_next_interval() -> None:
    first, joined = GatewayMetrics(), GatewayMetrics()
    _serve(first, 10, ttft=0.03, isl=100, osl=10)
    before = ingress_snapshot(_as_scraped({"a:8080": first}), "smol", at_s=0.0)
    _serve(first, 10, ttft=0.03, isl=100, osl=10)
    _serve(joined, 400, ttft=0.03, isl=100, osl=10)  # served before Prometheus first scraped it
    middle = ingress_snapshot(_as_scraped({"a:8080": first, "c:8080": joined}), "smol", at_s=10.0)
    assert ingress_stats(before, middle).request_rate == pytest.approx(1.0)  # the first's 10, none of the 400
    _serve(joined, 20, ttft=0.03, isl=100, osl=10)
    after = ingress_snapshot(_as_scraped({"a:8080": first, "c:8080": joined}), "smol", at_s=20.0)
    assert ingress_stats(middle, after).request_rate == pytest.approx(2.0)


def test_ingress_processes_read_one_by_one_are_each_a_source_so_a_restart_among_them_counts_right() -> None:
    """``--ingress-metrics``: each process's own /metrics text, labelled with where it was read."""
    first, second = GatewayMetrics(), GatewayMetrics()
    _serve(first, 300, ttft=0.03, isl=100, osl=10)
    _serve(second, 200, ttft=0.03, isl=100, osl=10)
    urls = ("http://127.0.0.1:9101", "http://127.0.0.1:9102")

    def read(a: GatewayMetrics, b: GatewayMetrics, at_s: float) -> IngressSnapshot:
        texts = {urls[0]: a.exposition().decode(), urls[1]: b.exposition().decode()}
        return ingress_snapshot(exposition_by_source(texts), "smol", at_s=at_s)

    before = read(first, second, 0.0)
    assert before.input_tokens.count == 500
    assert sorted(before.sources) == [(("instance", urls[0]),), (("instance", urls[1]),)]
    _serve(first, 30, ttft=0.03, isl=100, osl=10)
    restarted = GatewayMetrics()
    _serve(restarted, 20, ttft=2.0, isl=300, osl=10)
    stats = ingress_stats(before, read(first, restarted, 10.0))
    assert stats.request_rate == pytest.approx(5.0)  # 30 + 20 in 10 s, not the 350 a sum would have made of it
    assert stats.mean_isl == pytest.approx((30 * 100 + 20 * 300) / 50)


def test_a_metrics_text_that_is_not_one_of_several_ingresses_is_refused_naming_where_it_was_read() -> None:
    with pytest.raises(PlannerError, match=r"http://127.0.0.1:9102: not Prometheus text exposition"):
        exposition_by_source({"http://127.0.0.1:9101": "", "http://127.0.0.1:9102": "<html>{{oops"})


TTFT_FAMILY = "flotilla_frontend_time_to_first_token_seconds"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<html>not metrics {{", "not Prometheus text exposition"),
        (f'# TYPE {TTFT_FAMILY} histogram\n{TTFT_FAMILY}_bucket{{model="m"}} 1\n', "a bucket without a bound"),
        (f'# TYPE {TTFT_FAMILY} histogram\n{TTFT_FAMILY}_bucket{{model="m",le="NaN"}} 1\n', "without a bound"),
        (f'# TYPE {TTFT_FAMILY} histogram\n{TTFT_FAMILY}_bucket{{model="m",le="+Inf"}} NaN\n', "not a finite"),
        (f'# TYPE {TTFT_FAMILY} histogram\n{TTFT_FAMILY}_bucket{{model="m",le="+Inf"}} -3\n', "not a finite"),
        (f'# TYPE {TTFT_FAMILY} histogram\n{TTFT_FAMILY}_sum{{model="m"}} +Inf\n', "not a finite number"),
    ],
)
def test_ingress_metrics_the_planner_cannot_read_are_refused_not_believed(text: str, message: str) -> None:
    """An ingress's answer crosses a process boundary: nonsense is an error the loop reports (and plans in load
    mode on), never a crash or a count taken on trust."""
    with pytest.raises(PlannerError, match=message):
        check_ingress_exposition(text)
    with pytest.raises(PlannerError, match=message):
        ingress_snapshot(text, "m", at_s=0.0)


def test_the_gateways_own_metrics_pass_the_check() -> None:
    metrics = GatewayMetrics()
    _serve(metrics, 3, ttft=0.03, isl=100, osl=10)
    check_ingress_exposition(metrics.exposition().decode())
