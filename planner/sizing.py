"""What a mode's sizing returns, and the number formats of the reasons."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizing:
    """The replicas the load asks for, and why (a sentence for a person)."""

    wanted: int
    reason: str


def seconds(value: float) -> str:
    """``0.82 s``, ``0.045 s``, ``12 s``."""
    if value >= 10:
        return f"{value:.0f} s"
    if value >= 0.1:
        return f"{value:.2f} s"
    return f"{value:.3g} s"


def amount(value: float) -> str:
    """``14.2``, ``3,000``, ``0.35``: a rate or a length at a precision a person reads."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.1f}"
    return f"{value:.2g}"


def percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def replicas(count: int | float, role: str = "") -> str:
    """``1 replica``, ``3 prefill replicas``, ``2.4 decode replicas``."""
    label = f"{role} replica" if role and role != "aggregated" else "replica"
    text = str(count) if isinstance(count, int) else f"{count:.1f}"
    return f"{text} {label}{'' if count == 1 else 's'}"
