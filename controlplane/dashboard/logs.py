"""An instance's log tail for the pipeline page: what GET /api/v1/instances/{id}/log/ answers, as text.

It asks the node's agent with the API's own code (controlplane/deployments/log_tail.py), and the page shows
each of the API's refusals (409 not placed, 503 node offline or silent, 502 agent error) as a sentence
instead of an error page.
"""

from controlplane.deployments.log_tail import DEFAULT_LOG_LINES, LogTail, filter_lines, log_tail
from controlplane.deployments.log_tail import parse_grep as parse_api_grep
from controlplane.deployments.log_tail import parse_lines as parse_api_lines
from controlplane.errors import Invalid

__all__ = ["DEFAULT_LINES", "LogTail", "filter_lines", "log_tail", "parse_grep", "parse_lines"]

DEFAULT_LINES = DEFAULT_LOG_LINES


def parse_lines(raw: str | None) -> int:
    """The ``lines`` parameter: DEFAULT_LINES when absent. Raises ValueError naming it when it is not 1-10000."""
    try:
        return parse_api_lines(raw)
    except Invalid as exc:
        raise ValueError(f"lines: {exc.message}") from exc


def parse_grep(raw: str | None) -> str:
    """The ``grep`` filter: "" when absent. Raises ValueError naming it when it is too long or not one line."""
    try:
        return parse_api_grep(raw)
    except Invalid as exc:
        raise ValueError(f"grep: {exc.message}") from exc
