"""``manage.py planner``'s settings: where the latency histograms come from, and a bad one refused with exit 2
before anything starts."""

import pytest
from django.core.management import CommandError, call_command

from controlplane.planning.management.commands.planner import ingress_metrics_urls
from runtime.errors import ConfigError


def test_ingress_metrics_urls_are_comma_separated_base_urls_each_once() -> None:
    given = " http://127.0.0.1:9101/, http://127.0.0.1:9102,,http://127.0.0.1:9101"
    assert ingress_metrics_urls(given) == ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    assert ingress_metrics_urls("") == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"ingress_metrics": "127.0.0.1:9101"},
            "--ingress-metrics (FLOTILLA_PLANNER_INGRESS_METRICS) takes http(s) base URLs, comma-separated",
        ),
        (
            {"ingress_metrics": "http://127.0.0.1:9101", "prometheus": "http://127.0.0.1:9090"},
            "are two sources of the same histograms: give one",
        ),
        ({"prometheus": "127.0.0.1:9090"}, "must be a Prometheus server's http(s) base URL"),
        ({"gateway": "gateway:8080"}, "--gateway must be the gateway's http(s) base URL"),
    ],
)
def test_a_bad_source_of_latencies_exits_2_saying_what_to_give(options: dict[str, str], message: str) -> None:
    with pytest.raises(CommandError) as raised:
        call_command("planner", once=True, **options)
    assert raised.value.returncode == 2
    assert message in str(raised.value)


def test_the_variable_is_read_as_the_flag_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_PLANNER_INGRESS_METRICS", "http://127.0.0.1:9101,tcp://x")
    with pytest.raises(CommandError, match="not 'tcp://x'") as raised:
        call_command("planner", once=True)
    assert raised.value.returncode == 2


def test_a_url_with_a_space_inside_is_refused() -> None:
    with pytest.raises(ConfigError, match="takes http"):
        ingress_metrics_urls("http://127.0.0.1:9101 http://127.0.0.1:9102")
