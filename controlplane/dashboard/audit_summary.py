"""What an audit entry changed, for people: a one-line summary ("scaled aggregated 2 → 3") and the key by key
diff of its before/after snapshots that the entry's page shows.

Pure functions over the JSON an action recorded (controlplane/audit/records.py). Nested values are flattened
into paths: ``groups[decode].replicas`` (lists of records by their role, name or id), ``engine_args.max_loras``.
Snapshots leave secrets out (an API key's hash is excluded), but a value under a key named like a secret
(token, secret, password, hash, credential) is still never shown, in case one slips in: only that it changed.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]

#: Values in a summary are cut to about this many characters.
SUMMARY_VALUE_CHARS = 40
#: More changes than this make the summary the list of what changed, without values.
SUMMARY_MAX_PHRASES = 3
HIDDEN = "(hidden)"
ABSENT = "—"

# The words of a key's name that mark a secret ("hf_token", "key_hash", "client_secret"): whole words, so that
# "max_num_batched_tokens" is not one.
_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "hash", "credential", "credentials"})
# Keys the system bumps along with a change (a group's next replica ordinal, a record's version, a
# pipeline's router_generation and adapter_generation): they are in the diff, but in a summary only when
# nothing else changed.
_BOOKKEEPING = frozenset({"next_replica", "generation", "version"})
# How a list's records are told apart, in this order; a list of other things is one value.
_RECORD_KEYS = ("role", "name", "id")


@dataclass(frozen=True)
class Change:
    """One key of a diff: its path, its values (``ABSENT`` where the snapshot lacks it), and whether it is a
    secret (then both values are ``HIDDEN``)."""

    path: str
    before: Any
    after: Any
    secret: bool = False

    @property
    def changed(self) -> bool:
        return self.before != self.after


def is_secret(path: str) -> bool:
    """Whether a key of ``path`` is named like a secret."""
    return any(word in _SECRET_WORDS for word in re.split(r"[^a-z0-9]+", path.lower()))


def diff(before: JSON | None, after: JSON | None) -> list[Change]:
    """Every key of either snapshot, the changed ones first, each part in the snapshots' order."""
    old, new = flatten(before), flatten(after)
    paths = list(old) + [path for path in new if path not in old]
    changes = []
    for path in paths:
        was, now = old.get(path, ABSENT), new.get(path, ABSENT)
        if is_secret(path):
            changes.append(Change(path, HIDDEN, HIDDEN if was == now else f"{HIDDEN}, changed", secret=True))
        else:
            changes.append(Change(path, was, now))
    return [change for change in changes if change.changed] + [change for change in changes if not change.changed]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{path: value}`` for each leaf of a snapshot (None, {}: no keys). A list of records (dicts that all have
    a role, name or id) is flattened under ``[that]``; any other list is one value."""
    if value is None and not prefix:
        return {}
    if isinstance(value, dict):
        leaves: dict[str, Any] = {}
        for key, item in value.items():
            leaves.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return leaves  # an empty dict has no keys: what it gains later shows as added
    if isinstance(value, list) and value and prefix:
        label = _record_key(value)
        if label is not None:
            leaves = {}
            for item in value:
                leaves.update(flatten(item, f"{prefix}[{item[label]}]"))
            return leaves
    return {prefix: value}


def summarize(action: str, before: JSON | None, after: JSON | None) -> str:
    """One line saying what an entry changed: "created", "stopped", "scaled aggregated 2 → 3", "router
    round-robin → kv", "engine args changed (max_loras)", "adapter sql loaded", or "changed: a, b, c" when
    there is too much to say; "no change" when before and after agree."""
    noun = action.split(".", 1)[0].replace("_", " ")
    if before is None and after is None:
        return action.rsplit(".", 1)[-1].replace("_", " ")  # nothing to compare: what happened
    verb = action.rsplit(".", 1)[-1]
    # An entry with nothing before is a new record, unless it is a small note about one ("user.password"
    # records {"password": "reset"}): that says what it notes.
    if before is None and (verb in ("create", "deploy") or len(flatten(after)) > SUMMARY_MAX_PHRASES):
        return f"{noun} created"
    if after is None:
        return f"{noun} deleted"
    changes = [change for change in diff(before, after) if change.changed]  # before None: all added
    if not changes:
        return "no change"
    main: list[str] = []
    minor: list[str] = []
    engine_args: dict[str, list[str]] = {}
    for change in changes:
        leaf = re.sub(r"\[.*?\]", "", change.path).rsplit(".", 1)[-1]
        group = re.match(r"groups\[(.+?)\]\.", change.path)
        if change.secret:
            main.append(f"{change.path} changed")
        elif group and ".engine_args" in change.path:
            args = engine_args.setdefault(group.group(1), [])
            args.append(change.path.split(".engine_args.", 1)[-1])
        elif group and leaf == "replicas":
            main.append(f"scaled {group.group(1)} {_short(change.before)} → {_short(change.after)}")
        elif change.path == "adapters":
            main.extend(_adapter_phrases(change.before, change.after))
        elif change.path == "state" and change.after == "stopped":
            main.append("stopped")
        elif change.path == "state" and change.before == "stopped":
            main.append("started")
        elif change.path == "router_mode":
            main.append(f"router {_short(change.before)} → {_short(change.after)}")
        elif leaf in _BOOKKEEPING or leaf.endswith("_generation"):
            minor.append(_value_phrase(change))
        elif leaf.endswith("_at") and change.before not in (None, ABSENT) and change.after not in (None, ABSENT):
            minor.append(_value_phrase(change))  # a timestamp moved on: how, the diff says
        else:
            main.append(_value_phrase(change))
    groups = (after or {}).get("groups")
    several_groups = isinstance(groups, list) and len(groups) > 1
    for role, names in engine_args.items():
        where = f"{role} " if several_groups else ""
        main.append(f"{where}engine args changed ({', '.join(names)})")
    phrases = main or minor
    if len(phrases) > SUMMARY_MAX_PHRASES:
        keys = list(dict.fromkeys(change.path.split(".", 1)[0].split("[", 1)[0] for change in changes))
        return "changed: " + ", ".join(keys)
    return "; ".join(phrases)


def _record_key(items: list[Any]) -> str | None:
    if not all(isinstance(item, dict) for item in items):
        return None
    for key in _RECORD_KEYS:
        if all(item.get(key) not in (None, "") for item in items):
            return key
    return None


def _adapter_phrases(before: Any, after: Any) -> list[str]:
    was = set(before) if isinstance(before, list) else set()
    now = set(after) if isinstance(after, list) else set()
    return [f"adapter {name} loaded" for name in sorted(now - was)] + [
        f"adapter {name} unloaded" for name in sorted(was - now)
    ]


def _value_phrase(change: Change) -> str:
    if change.before in (None, ABSENT) and change.after not in (None, ABSENT) and change.path.endswith("_at"):
        return f"{change.path} set"
    if change.after in (None, ABSENT) and change.path.endswith("_at"):
        return f"{change.path} cleared"
    return f"{change.path} {_short(change.before)} → {_short(change.after)}"


def _short(value: Any) -> str:
    """A value as a summary shows it: strings bare, the rest as JSON, cut to ``SUMMARY_VALUE_CHARS``."""
    if value is None:
        return "none"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= SUMMARY_VALUE_CHARS else text[: SUMMARY_VALUE_CHARS - 1] + "…"


def show(value: Any) -> str:
    """A value as the diff table shows it, in full: strings bare, the rest as JSON."""
    if value is None:
        return "none"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
