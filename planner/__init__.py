"""The planner's decision core: from measurements and targets to each worker group's desired replicas.

Pure: no clock, no I/O, no Django, no engines. The control plane's loop (not here yet) builds an
``Observation`` each interval (``planner.measure``), calls ``Planner.decide`` and acts on the decisions
through its own actions. docs/planner.md says what it decides and how.
"""

from planner.core import Planner
from planner.decision import Bound, Decision, Mode
from planner.errors import PlannerError, ProfileError, SettingsError
from planner.observation import GroupObservation, Observation, ReplicaLoad
from planner.profile import CapacityCurve, Profile
from planner.settings import GroupTargets, LoadThresholds, Role, Stability, Targets

__all__ = [
    "Bound",
    "CapacityCurve",
    "Decision",
    "GroupObservation",
    "GroupTargets",
    "LoadThresholds",
    "Mode",
    "Observation",
    "Planner",
    "PlannerError",
    "Profile",
    "ProfileError",
    "ReplicaLoad",
    "Role",
    "SettingsError",
    "Stability",
    "Targets",
]
