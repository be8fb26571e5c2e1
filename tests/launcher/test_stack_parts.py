"""Which parts of `flotilla up` the OpenAI endpoint needs, and what `up` says when it gives up on one it does not."""

import pytest

from launcher.stack.options import build_up_parser, parse_up_options
from launcher.stack.parts import ROLES, given_up_report, role_of


def test_only_the_gateway_etcd_and_nats_are_on_the_serving_path() -> None:
    assert {name for name, role in ROLES.items() if role.serving} == {"gateway", "etcd", "nats"}
    assert {name for name, role in ROLES.items() if not role.serving} == {
        "redis",
        "controlplane",
        "celery",
        "live-bridge",
        "planner",
        "agent",
    }


def test_every_part_off_the_serving_path_says_what_no_longer_works_without_it() -> None:
    assert all(role.without_it for role in ROLES.values() if not role.serving)


def test_a_part_nobody_classified_is_refused_rather_than_guessed() -> None:
    with pytest.raises(KeyError):
        role_of("new-part")


def test_the_report_of_a_part_given_up_on_names_what_is_lost_its_log_and_when_it_starts_again() -> None:
    report = given_up_report(
        "the planner exited with code 1, its 6th end within 120 s: it keeps failing",
        role_of("planner"),
        "/data/logs/planner.log",
        "Traceback\nRuntimeError: boom\n",
        300.0,
    )
    assert report.splitlines() == [
        "flotilla up: ERROR: the planner exited with code 1, its 6th end within 120 s: it keeps failing.",
        "  The OpenAI endpoint does not need it: it goes on serving, and `flotilla up` keeps running.",
        "  No longer works meanwhile: the planner scales no pipeline.",
        "  The last lines of its log (/data/logs/planner.log):",
        "    Traceback",
        "    RuntimeError: boom",
        "  `flotilla up` starts it again in 300 s (--retry-given-up), and so after each give-up;",
        "  to start it at once, fix what its log says and restart `flotilla up` (Ctrl-C, then run it again).",
    ]


def test_the_retry_of_a_part_given_up_on_is_five_minutes_unless_set() -> None:
    parser = build_up_parser()
    assert parse_up_options(parser, parser.parse_args(["--no-pipeline"])).restarts.retry_given_up_s == 300.0
    options = parse_up_options(parser, parser.parse_args(["--no-pipeline", "--retry-given-up", "2.5"]))
    assert options.restarts.retry_given_up_s == 2.5


def test_a_retry_of_zero_seconds_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_up_parser().parse_args(["--retry-given-up", "0"])
    assert exit_info.value.code == 2
    assert "--retry-given-up" in capsys.readouterr().err
