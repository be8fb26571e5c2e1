"""The planner's errors: a bad setting, and a bad profile (each of whose problems names its field)."""


class PlannerError(Exception):
    """Base of the planner's errors."""


class SettingsError(PlannerError, ValueError):
    """A target or setting that cannot be planned with (a negative bound, a percentile out of range...).

    ``field`` is the setting at fault as the JSON form writes it (``groups.prefill.ttft_s``; "" when the
    whole is), so that the control plane can put the message next to the field.
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class ProfileError(PlannerError, ValueError):
    """A profile that does not validate; ``problems`` lists each one as (field path, what is wrong).

    The path reads as the JSON does (``decode.points[2].tokens_per_s``) so that an editing form can put the
    message next to its field.
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" if path else message for path, message in problems))
