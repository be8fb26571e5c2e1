"""Engine args that run a model repo's own code on the nodes: ``trust_remote_code``, an admin's decision.

vLLM, SGLang and TensorRT-LLM take ``trust_remote_code`` (in a worker's ``--extra-engine-args``): the
engine then imports the Python files of the model's repo (its modelling and tokenizer code) in the worker.
Whoever sets it, and whoever controls that repo, runs code on every node the pipeline is placed on, as the
worker's user. So turning it on is a power of its own (``Permission.TRUST_REMOTE_CODE``, the admins'):

* in a model's default engine args, and changing the source, revision or file of a model whose defaults turn
  it on (that swaps the code trusted), see ``check_model_change``;
* in a worker group's own engine args, at deploy or in a group update, see ``check_group_change``. A group of
  a model whose defaults turn it on inherits the admin's decision for that model.

Turning it off, or leaving it as it was, needs nothing. Each change of whether it is on writes an audit entry
of its own (``<model|pipeline>.trust_remote_code``), so that the audit log lists every one.

``trusts_remote_code`` reads every spelling the engines and ``engine_argv`` accept: the key itself
(``trust_remote_code``, ``trust-remote-code``, as a ``--`` flag too), at any depth of the object, and inside a
``--extra-engine-args`` value given as a JSON string. A value counts as on unless it is plainly off
(``false``, ``0``, ``no``, ``off``, ``null``, empty): a YAML engine reads ``yes`` and ``on`` as true. A
string that is not JSON (TensorRT-LLM reads YAML) counts as on when it names the key at all.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.db import models

from controlplane.accounts.models import Permission
from controlplane.audit.records import Actor, record
from controlplane.errors import Forbidden

_KEY = "trust_remote_code"
_OFF = frozenset({"", "false", "0", "no", "off", "null", "none"})
# How deep an args object is read: the API refuses objects nested deeper than 8 levels anyway.
_MAX_DEPTH = 16


def trusts_remote_code(args: Any) -> bool:
    """Whether engine args (a JSON object, as a group or a model holds them) turn ``trust_remote_code`` on."""
    return _trusts(args, 0)


def _trusts(value: Any, depth: int) -> bool:
    if depth > _MAX_DEPTH:
        return True  # deeper than anything the API accepts: refuse to guess that it is off
    if isinstance(value, Mapping):
        for key, item in value.items():
            if _is_the_key(key) and _is_on(item):
                return True
            if _trusts(item, depth + 1):
                return True
        return False
    if isinstance(value, list):
        return any(_trusts(item, depth + 1) for item in value)
    if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
        # An inline --extra-engine-args (engine_argv passes a string value through as the flag's value).
        try:
            decoded = json.loads(value)
        except ValueError:
            return _names_the_key(value)  # YAML (TensorRT-LLM's): not parsed here, so any mention counts
        return _trusts(decoded, depth + 1)
    return False


def _is_the_key(key: Any) -> bool:
    return isinstance(key, str) and key.lstrip("-").replace("-", "_").lower() == _KEY


def _names_the_key(text: str) -> bool:
    return _KEY in text.replace("-", "_").lower()


def _is_on(value: Any) -> bool:
    if value is None or value is False or value == 0:
        return False
    if isinstance(value, str):
        return value.strip().lower() not in _OFF
    return True


@dataclass(frozen=True)
class RemoteCodeChange:
    """Whether remote code was trusted before a change and is after it (``source``: its source changed too)."""

    was: bool
    now: bool
    source: bool = False

    @property
    def worth_recording(self) -> bool:
        return self.was != self.now or (self.now and self.source)


def check_model_change(
    actor: Actor, *, before: Mapping[str, Any] | None, after: Mapping[str, Any], source_changed: bool
) -> RemoteCodeChange:
    """Refuse a model change that turns remote code on, or changes the source of a model that trusts it,
    unless ``actor`` holds TRUST_REMOTE_CODE. ``before``/``after`` are its default engine args (``before``
    None: a new model). Raises Forbidden."""
    change = RemoteCodeChange(
        was=before is not None and trusts_remote_code(before), now=trusts_remote_code(after), source=source_changed
    )
    if change.now and (not change.was or source_changed):
        what = "a new source for a model whose default engine args" if change.was else "the model's default engine args"
        _require(actor, f"{what} turn on trust_remote_code")
    return change


def check_group_change(
    actor: Actor, *, before: Mapping[str, Any] | None, after: Mapping[str, Any], role: str
) -> RemoteCodeChange:
    """Refuse a worker group's engine args that turn remote code on (``before`` None: a new group) unless
    ``actor`` holds TRUST_REMOTE_CODE. Raises Forbidden."""
    change = RemoteCodeChange(was=before is not None and trusts_remote_code(before), now=trusts_remote_code(after))
    if change.now and not change.was:
        _require(actor, f"the {role} group's engine args turn on trust_remote_code")
    return change


def record_change(actor: Actor, target: models.Model, change: RemoteCodeChange, *, kind: str, where: str) -> None:
    """The audit entry of ``change`` to ``target`` (a model or a pipeline), when it is worth one; ``kind`` names
    the target's kind in the action (``model``, ``pipeline``), ``where`` the args that say so. Call it inside
    the action's transaction."""
    if not change.worth_recording:
        return
    after: dict[str, Any] = {"trust_remote_code": change.now, "where": where}
    if change.source:
        after["source_changed"] = True
    record(actor, f"{kind}.trust_remote_code", target, before={"trust_remote_code": change.was}, after=after)


def _require(actor: Actor, what: str) -> None:
    if not actor.holds(Permission.TRUST_REMOTE_CODE):
        raise Forbidden(
            f"{what}: the engine would run the model repo's own Python code on the nodes. Only an admin may allow "
            f"that ({actor.name} is not one); ask an admin, or leave trust_remote_code out"
        )
