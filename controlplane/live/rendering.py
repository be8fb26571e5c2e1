"""A change notice, rendered: the partial of the row (or list) that changed, or, for a deleted row, its
removal. Each is rendered for one of two audiences, people who may act (with the controls) and people who may
not (without them: they are left out of the HTML, not hidden).

Renderers come from controlplane/dashboard/partials.py, the same partials the pages include. They run
Django's ORM and templates: ``render_each`` belongs in a thread; ``SharedRenders`` puts it there.
"""

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Sequence

from channels.db import database_sync_to_async
from django.core.exceptions import ObjectDoesNotExist
from django.utils.html import format_html

from controlplane.dashboard import partials
from controlplane.live.groups import Kind

log = logging.getLogger(__name__)

# Each takes the row's id and whether the audience may act.
_RENDERERS: dict[Kind, Callable[[int, bool], str]] = {
    "node": lambda pk, can_act: partials.render_node(pk, can_act=can_act),
    "nodes": lambda _, can_act: partials.render_node_table(can_act=can_act),
    "pipeline": lambda pk, can_act: partials.render_pipeline_row(pk, can_act=can_act),
    "pipelines": lambda _, can_act: partials.render_pipeline_table(can_act=can_act),
    "instances": lambda pk, can_act: partials.render_pipeline_instances(pk, can_act=can_act),
    "instance": lambda pk, can_act: partials.render_instance(pk, can_act=can_act),
    "download": lambda pk, _: partials.render_download(pk),
    "downloads": lambda _, __: partials.render_download_table(),
    "models": lambda _, __: partials.render_model_table(),
    "audit": lambda pk, _: partials.render_audit_entry(pk),
    "planner": lambda pk, can_act: partials.render_pipeline_planner(pk, can_act=can_act),
    "instance_detail": lambda pk, _: partials.render_instance_detail(pk),
}
# The id of the element each kind's partial renders (controlplane/dashboard/partials.py): a prefix and
# the row's id, or the one id of a fleet list.
_ELEMENT_PREFIX: dict[Kind, str] = {
    "node": "node",
    "pipeline": "pipeline",
    "instances": "instances",
    "instance": "instance",
    "download": "download",
    "audit": "audit",
    "planner": "planner",
    "instance_detail": "detail",
}
_LIST_ELEMENT: dict[Kind, str] = {
    "nodes": partials.NODE_TABLE_ID,
    "pipelines": partials.PIPELINE_TABLE_ID,
    "downloads": partials.DOWNLOAD_TABLE_ID,
    "models": partials.MODEL_TABLE_ID,
}


def element_id(kind: Kind, row_id: int) -> str:
    """The id of the page element that shows row ``row_id`` of ``kind`` (a fleet list's one element)."""
    if kind in _LIST_ELEMENT:
        return _LIST_ELEMENT[kind]
    return f"{_ELEMENT_PREFIX[kind]}-{row_id}"


def removal(kind: Kind, row_id: int) -> str:
    """An element that makes htmx delete the element of a deleted row, wherever a page shows it."""
    return str(format_html('<div id="{}" hx-swap-oob="delete"></div>', element_id(kind, row_id)))


def render_each(changes: Iterable[tuple[Kind, int]], *, can_act: bool) -> list[str]:
    """The partial of each change, for people who may act or not (a removal for a deleted row; "" for a
    partial that failed, which is logged: the page keeps the element it has)."""
    parts = []
    for kind, row_id in changes:
        try:
            parts.append(_RENDERERS[kind](row_id, can_act))
        except ObjectDoesNotExist:
            parts.append(removal(kind, row_id))
        except Exception:
            log.exception("live updates: the %s partial of %d failed; pages keep the element they have", kind, row_id)
            parts.append("")
    return parts


class SharedRenders:
    """Renders shared by the sockets of one process: ten pages watching a node render it once per change.

    A render started after a socket heard of a change shows that change (the notice left after the
    commit), so a socket takes any render of the row that started at or after it heard, finished or
    running, and starts one only when there is none. Renders run in Django's database thread, as tasks of
    their own: a socket that closes while waiting does not cancel what the others wait for.
    """

    #: Renders older than this are forgotten (a socket that heard of a change later needs a newer one).
    KEEP_S = 10.0

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        # By row and audience (whether it may act).
        self._latest: dict[tuple[Kind, int, bool], tuple[float, asyncio.Future[str]]] = {}
        self.started = 0  # renders started, for tests

    async def render(self, wanted: Sequence[tuple[tuple[Kind, int], float]], *, can_act: bool) -> str:
        """The elements of ``wanted`` (each a row and when this socket heard it changed), as one message, for a
        person who may act (``can_act``) or not."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # tests run a loop each; futures belong to one
            self._loop, self._latest = loop, {}
        now = loop.time()
        futures: list[asyncio.Future[str]] = []
        missing: list[tuple[Kind, int]] = []
        for (kind, row_id), heard_at in wanted:
            entry = self._latest.get((kind, row_id, can_act))
            if entry is not None and entry[0] >= heard_at:
                futures.append(entry[1])
            else:
                missing.append((kind, row_id))
        if missing:
            batch = asyncio.ensure_future(database_sync_to_async(render_each)(missing, can_act=can_act))
            self.started += len(missing)
            for index, (kind, row_id) in enumerate(missing):
                part: asyncio.Future[str] = loop.create_future()
                part.add_done_callback(_retrieve)  # a failure nobody waits for any more is no warning
                batch.add_done_callback(functools.partial(_settle, part, index))
                self._latest[(kind, row_id, can_act)] = (now, part)
                futures.append(part)
            self._forget_old(now)
        parts = []
        for future in futures:
            try:
                parts.append(await asyncio.shield(future))
            except Exception:  # logged where it failed; the page keeps its element
                parts.append("")
        return "".join(parts)

    def _forget_old(self, now: float) -> None:
        if len(self._latest) > 256:
            self._latest = {key: entry for key, entry in self._latest.items() if entry[0] + self.KEEP_S > now}


def _retrieve(future: "asyncio.Future[str]") -> None:
    if not future.cancelled():
        future.exception()


def _settle(part: "asyncio.Future[str]", index: int, batch: "asyncio.Future[list[str]]") -> None:
    if part.done():
        return
    if batch.cancelled():
        part.set_exception(RuntimeError("the render was cancelled"))
    elif (error := batch.exception()) is not None:
        part.set_exception(error)
    else:
        part.set_result(batch.result()[index])
