"""The dashboard's ``age`` filter: seconds under a minute, Django's ``timesince`` beyond."""

from datetime import UTC, datetime, timedelta

import pytest
from django.template import Context, Template

from controlplane.dashboard.templatetags.age import age

NOW = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("seconds_ago", "expected"),
    [
        (0, "0 seconds"),
        (1, "1 second"),
        (12.7, "12 seconds"),
        (59.9, "59 seconds"),
        (60, "1\xa0minute"),
        (3 * 3600 + 5 * 60, "3\xa0hours, 5\xa0minutes"),
        (-5, "0 seconds"),  # clocks a little apart: never a negative age
    ],
)
def test_age(seconds_ago: float, expected: str) -> None:
    assert age(NOW - timedelta(seconds=seconds_ago), NOW) == expected


def test_no_moment_is_empty() -> None:
    assert age(None, NOW) == ""


def test_the_filter_loads_in_templates() -> None:
    rendered = Template("{% load age %}{{ moment|age }}").render(Context({"moment": datetime.now(UTC)}))
    assert rendered.endswith("second") or rendered.endswith("seconds")
    assert rendered.split()[0].isdigit()
