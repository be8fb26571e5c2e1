"""Who hears what: the channel-layer groups of the dashboard's sockets, and the messages sent to them.

* ``fleet.<topic>``: the fleet pages (overview, nodes, models, pipelines), one group per topic:
  ``nodes`` (nodes and their GPUs), ``pipelines`` (pipelines' rows), ``downloads``, ``models`` (the
  catalog), ``audit`` (audit entries) and ``load`` (the bridge's KV figures per pipeline, for the
  overview). A page joins the topics it shows (all, unless it names some; each page names them), so that a
  page without nodes renders no node.
* ``pipeline.<pk>``: the detail page of one pipeline; it hears about that pipeline's row, its list of
  instances and each instance, and the bridge's load figures of its instances and phases of its groups.
  An instance's page joins its pipeline's group too, and keeps only what is about its instance.

Two kinds of message travel: ``live.changed`` names a row that changed (each socket renders its
partial, so a burst of changes to one row costs one render per socket), ``live.html`` carries HTML
rendered once by its sender (the bridge's load figures), which each socket forwards as it is.
"""

from typing import Literal, NotRequired, TypedDict

#: The fleet's topics and their groups.
AUDIT_TOPIC = "audit"  # audit entries: only for people who may read the audit log
FLEET_TOPICS = ("nodes", "pipelines", "downloads", "models", AUDIT_TOPIC, "load")
NODES, PIPELINES, DOWNLOADS, MODELS, AUDIT, LOAD = (f"fleet.{topic}" for topic in FLEET_TOPICS)


def fleet_group(topic: str) -> str:
    """The group of a fleet topic (one of FLEET_TOPICS)."""
    return f"fleet.{topic}"


#: What sockets hear of changing; each has a partial in controlplane/dashboard/partials.py. A plural is a
#: whole list, pushed when a row joins or leaves it (a changed row is pushed alone): "instances" is a
#: pipeline's list of instances (id: the pipeline's); "nodes", "pipelines", "downloads" and "models" are
#: the fleet's lists (id: ``FLEET_LIST``).
#: "planner" is a pipeline's planner panel (id: the pipeline's), pushed after each of its decisions.
#: "instance_detail" is an instance page's state, placement, timeline and restarts: never sent to a group,
#: an instance page's socket renders it when it hears of its instance ("instance", or its list).
Kind = Literal[
    "node",
    "nodes",
    "pipeline",
    "pipelines",
    "instances",
    "instance",
    "download",
    "downloads",
    "models",
    "audit",
    "planner",
    "instance_detail",
]
#: The id of a notice about one of the fleet's lists, of which there is one each.
FLEET_LIST = 0


def pipeline_group(pipeline_id: int) -> str:
    """The group of the sockets watching pipeline ``pipeline_id``."""
    return f"pipeline.{pipeline_id}"


class Changed(TypedDict):
    """``live.changed``: row ``id`` of ``kind`` changed or was deleted; sockets render it again."""

    type: Literal["live.changed"]
    kind: Kind
    id: int


class Html(TypedDict):
    """``live.html``: elements to swap in as they are (htmx's ws extension swaps them by id)."""

    type: Literal["live.html"]
    html: str
    # The instance whose load it shows, or the worker group whose phases, for tests and logs.
    instance: NotRequired[int]
    group: NotRequired[int]


def changed(kind: Kind, row_id: int) -> Changed:
    return {"type": "live.changed", "kind": kind, "id": row_id}


def html(text: str, *, instance: int | None = None, group: int | None = None) -> Html:
    message: Html = {"type": "live.html", "html": text}
    if instance is not None:
        message["instance"] = instance
    if group is not None:
        message["group"] = group
    return message
