"""Capacity the dashboard warns about but placement does not enforce.

CPU replicas are placed by free system memory only: a node's CPUs are shared by its CPU instances, which all
run, each slower than alone. More CPU instances than a node has CPUs is often a mistake (4 llama.cpp
replicas on a 2-CPU node), but not always (a mocker uses little CPU), so it is a warning on the node's row and
on those instances' rows, never a refusal.
"""


def cpu_oversubscription(cpu_instances: int | None, cpu_count: int | None) -> str:
    """A warning when a node's ``cpu_instances`` (live instances of 0-GPU groups placed there) outnumber its
    ``cpu_count``; "" when they do not, or when the node's agent did not say how many CPUs it has (0)."""
    if not cpu_count or not cpu_instances or cpu_instances <= cpu_count:
        return ""
    return f"{cpu_instances} CPU instances on {cpu_count} CPUs: they share them, each serving slower than alone"
