"""controlplane/planning/observe.py: what the loop gathered, put together as the planner's Observation."""

from controlplane.planning.observe import GroupView, PipelineView, observe
from planner.measure import IngressStats
from runtime.kv.events import WorkerLoad

PIPELINE = PipelineView(1, "chat", {}, None, (GroupView("aggregated", 1, 1, frozenset({7})),))
QUIET = IngressStats(1.0, 0.0, mean_isl=None, mean_osl=None, percentile=90.0, ttft_s=None, itl_s=None)


def test_waiting_requests_are_counted_in_predicted_prompt_lengths_when_none_finished_in_the_interval() -> None:
    # Requests longer than the interval: none finished, so the interval gives no ISL, yet three are queued.
    report = WorkerLoad(instance_id=7, active_requests=5, running=2, waiting=3)
    seen = observe(PIPELINE, [report], QUIET, interval_s=1.0, percentile=90, rate_when_unknown=0, isl_when_unknown=500)
    [load] = seen.groups[0].loads
    assert load.queued_prefill_tokens == 1500.0


def test_the_intervals_own_mean_prompt_length_comes_before_the_prediction() -> None:
    stats = IngressStats(1.0, 2.0, mean_isl=100.0, mean_osl=10.0, percentile=90.0, ttft_s=0.1, itl_s=0.01)
    report = WorkerLoad(instance_id=7, active_requests=5, running=2, waiting=3)
    seen = observe(PIPELINE, [report], stats, interval_s=1.0, percentile=90, rate_when_unknown=0, isl_when_unknown=500)
    assert seen.groups[0].loads[0].queued_prefill_tokens == 300.0
