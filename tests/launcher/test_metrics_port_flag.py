"""``--metrics-port``: a worker's own /metrics, and a clear error where there is no worker to serve it."""

import pytest

from launcher.cli import parse_run_options
from launcher.run_parser import build_run_parser


def test_a_worker_takes_a_metrics_port_from_its_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_run_parser()
    args = ["in=dyn://llm.backend.generate", "out=echo_core", "--metrics-port", "9100"]
    assert parse_run_options(parser, parser.parse_intermixed_args(args)).metrics_port == 9100
    monkeypatch.setenv("FLOTILLA_METRICS_PORT", "9101")
    parser = build_run_parser()
    args = ["in=dyn://llm.backend.generate", "out=echo_core"]
    assert parse_run_options(parser, parser.parse_intermixed_args(args)).metrics_port == 9101


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["in=http", "out=dyn", "--metrics-port", "9100"], "in=http serves /metrics on --http-port"),
        (["in=text", "out=echo_full", "--metrics-port", "9100"], "in=text has no /metrics"),
        (["in=dyn://llm.backend.generate", "out=echo_core", "--metrics-port", "70000"], "not a TCP port"),
    ],
)
def test_a_metrics_port_outside_a_worker_or_out_of_range_is_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_run_parser()
    with pytest.raises(SystemExit) as exited:
        parse_run_options(parser, parser.parse_intermixed_args(args))
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
