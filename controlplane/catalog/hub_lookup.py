"""Looking models up on the Hugging Face hub before adding one: a search, and one repo's files and config.

The dashboard asks while a person waits, so every request has a short timeout (HF_HUB_ETAG_TIMEOUT, at most
``MAX_TIMEOUT_S``), and the hub is reached as the agents reach it (HF_ENDPOINT, HF_TOKEN: runtime's
``HubSettings``). The requests are those huggingface_hub's ``list_models`` and ``model_info`` make
(``GET /api/models?search=…&limit=…&full=true``, ``GET /api/models/{repo}[/revision/{rev}]?blobs=true``) and
the file URL of ``hf_hub_download`` (``/{repo}/resolve/{rev}/config.json``), made with httpx so that each has a
timeout of its own and nothing is cached on disk.

Every failure is a ``HubLookupFailed`` whose message names the endpoint and what to do (set HF_ENDPOINT to a
mirror, or add the model from a local folder); nothing else escapes.
"""

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from controlplane.catalog.errors import HubLookupFailed
from controlplane.catalog.memory import config_subset
from runtime.models.hub_download import HubCaller, HubError, HubSettings, pick_files
from runtime.models.source import HubModel

DEFAULT_ENDPOINT = "https://huggingface.co"
#: How many repos a search lists (the hub's most downloaded first).
SEARCH_LIMIT = 20
#: The longest wait for one answer of the hub: a person is waiting on the page.
MAX_TIMEOUT_S = 5.0
# A config.json larger than this is not a model's config (memory.py reads local ones with the same bound).
_MAX_CONFIG_BYTES = 1 << 20
#: What the remedies of a lookup's errors say; ``quant_tags`` as the agent's (agent/downloads.py), which
#: downloads what the catalog adds: the files picked here are the files a node will fetch.
CATALOG = HubCaller(
    quant_tags=False,
    local_path="add the model from a local folder or GGUF file",
    cache="the nodes' models folders",
    who=" for the control plane",
)


@dataclass(frozen=True, slots=True)
class HubRepo:
    """One repo of a search's results."""

    id: str
    downloads: int | None
    likes: int | None
    last_modified: str | None
    pipeline_tag: str | None
    has_gguf: bool
    has_safetensors: bool


@dataclass(frozen=True, slots=True)
class RepoFacts:
    """What the hub says of one repo at one revision, for an estimate before it is added.

    ``size_bytes`` is the sum of the files a node's download would fetch (``picked``, hub_download's
    ``pick_files``), None when the hub did not give every size or no file could be picked (``pick_problem``
    says why, e.g. a repo of several GGUF files that needs one named: ``gguf_files``).
    """

    repo: str
    revision: str
    picked: list[str]
    file: str | None
    size_bytes: int | None
    config: dict[str, Any]
    gguf_files: list[str] = field(default_factory=list)
    gguf_context_length: int | None = None
    pick_problem: str = ""
    #: Its llama.cpp multimodal projectors (``mmproj`` GGUF files), which give the model images, and their sizes
    #: (None where the hub gave none).
    projector_files: list[str] = field(default_factory=list)
    projector_sizes: dict[str, int | None] = field(default_factory=dict)

    @property
    def projector(self) -> str | None:
        """The projector to serve a GGUF file of the repo with: the f16 one where there are several (llama.cpp's
        own conversions publish it beside smaller ones), else the first; None without one."""
        if not self.projector_files:
            return None
        return next((name for name in self.projector_files if "f16" in name.lower()), self.projector_files[0])


def endpoint_of(hub: HubSettings) -> str:
    return (hub.endpoint or DEFAULT_ENDPOINT).rstrip("/")


def search(hub: HubSettings, query: str) -> list[HubRepo]:
    """The hub's repos matching ``query``, most downloaded first. Raises HubLookupFailed."""
    params = {"search": query, "limit": str(SEARCH_LIMIT), "full": "true", "sort": "downloads"}
    answer = _get_json(hub, "/api/models", params, what=f"the search for {query!r}")
    if not isinstance(answer, list):
        raise HubLookupFailed(_malformed(hub, "the search's answer is not a list"))
    return [repo for item in answer[:SEARCH_LIMIT] if (repo := _repo(item)) is not None]


def repo_facts(hub: HubSettings, repo: str, revision: str | None = None, file: str | None = None) -> RepoFacts:
    """The files, size and config of ``repo`` at ``revision`` (None: its default branch), with ``file`` the GGUF
    file to serve when it holds several. Raises HubLookupFailed (no such repo, revision or file included)."""
    path = f"/api/models/{repo}" if not revision else f"/api/models/{repo}/revision/{quote(revision, safe='')}"
    info = _get_json(hub, path, {"blobs": "true"}, what=f"repo {repo!r}")
    if not isinstance(info, dict) or not isinstance(info.get("siblings"), list):
        raise HubLookupFailed(_malformed(hub, f"its answer about {repo!r} lists no files"))
    sizes: dict[str, int | None] = {}
    for sibling in info["siblings"]:
        if isinstance(sibling, dict) and isinstance(sibling.get("rfilename"), str):
            size = sibling.get("size")
            sizes[sibling["rfilename"]] = size if isinstance(size, int) and size >= 0 else None
    sha = info.get("sha") if isinstance(info.get("sha"), str) else None
    pinned = sha or revision or "main"
    gguf_files = sorted(name for name in sizes if name.endswith(".gguf"))
    projectors = [name for name in gguf_files if "mmproj" in name.rsplit("/", 1)[-1].lower()]
    gguf = info.get("gguf")
    gguf_context = gguf.get("context_length") if isinstance(gguf, dict) else None
    facts = RepoFacts(
        repo=repo,
        revision=pinned,
        picked=[],
        file=None,
        size_bytes=None,
        config={},
        gguf_files=gguf_files,
        gguf_context_length=gguf_context if isinstance(gguf_context, int) and gguf_context > 0 else None,
        projector_files=projectors,
        projector_sizes={name: sizes[name] for name in projectors},
    )
    try:
        plan = pick_files(HubModel(repo, file or None, revision or None), sorted(sizes), CATALOG)
    except HubError as exc:
        return dataclasses.replace(facts, pick_problem=str(exc))
    known = [sizes[name] for name in plan.names]
    size = sum(each for each in known if each is not None) if all(each is not None for each in known) else None
    config = _config(hub, repo, pinned) if "config.json" in sizes and plan.file is None else {}
    return dataclasses.replace(facts, picked=plan.names, file=plan.file, size_bytes=size, config=config)


def _config(hub: HubSettings, repo: str, revision: str) -> dict[str, Any]:
    """The part of the repo's config.json the estimate reads; {} when it is not a JSON object (an estimate
    without a KV part, as for a local folder with such a config)."""
    path = f"/{repo}/resolve/{quote(revision, safe='')}/config.json"
    response = _get(hub, path, {}, what=f"the config.json of {repo!r}")
    if len(response.content) > _MAX_CONFIG_BYTES:
        return {}
    try:
        values = json.loads(response.content)
    except ValueError:
        return {}
    return config_subset(values) if isinstance(values, dict) else {}


def _repo(item: Any) -> HubRepo | None:
    if not isinstance(item, Mapping) or not isinstance(item.get("id"), str):
        return None
    tags = [tag for tag in item.get("tags") or [] if isinstance(tag, str)]
    names = [sibling.get("rfilename", "") for sibling in item.get("siblings") or [] if isinstance(sibling, Mapping)]
    return HubRepo(
        id=item["id"],
        downloads=_count(item.get("downloads")),
        likes=_count(item.get("likes")),
        last_modified=item["lastModified"] if isinstance(item.get("lastModified"), str) else None,
        pipeline_tag=item["pipeline_tag"] if isinstance(item.get("pipeline_tag"), str) else None,
        has_gguf="gguf" in tags or any(str(name).endswith(".gguf") for name in names),
        has_safetensors="safetensors" in tags or any(str(name).endswith(".safetensors") for name in names),
    )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _get_json(hub: HubSettings, path: str, params: dict[str, str], *, what: str) -> Any:
    response = _get(hub, path, params, what=what)
    try:
        return response.json()
    except ValueError as exc:
        raise HubLookupFailed(_malformed(hub, f"its answer for {what} is not JSON")) from exc


def _get(hub: HubSettings, path: str, params: dict[str, str], *, what: str) -> httpx.Response:
    """GET ``path`` of the hub; raises HubLookupFailed for anything but a 200."""
    endpoint = endpoint_of(hub)
    if hub.offline:
        raise HubLookupFailed(
            f"HF_HUB_OFFLINE is set for the control plane, so it does not ask the hub at {endpoint}: unset it, "
            f"or {CATALOG.local_path}"
        )
    headers = {"Authorization": f"Bearer {hub.token}"} if hub.token else {}
    timeout = min(hub.timeout_s, MAX_TIMEOUT_S)
    try:
        with httpx.Client(timeout=timeout, follow_redirects=True, headers=headers) as client:
            response = client.get(f"{endpoint}{path}", params=params)
    except httpx.TimeoutException as exc:
        raise HubLookupFailed(
            f"the Hugging Face hub at {endpoint} did not answer {what} within {timeout:g} s: try again, set "
            f"HF_ENDPOINT to a mirror you can reach, or {CATALOG.local_path}"
        ) from exc
    except httpx.HTTPError as exc:
        raise HubLookupFailed(
            f"cannot reach the Hugging Face hub at {endpoint} ({type(exc).__name__}: {exc}): check the network, "
            f"set HF_ENDPOINT to a mirror you can reach, or {CATALOG.local_path}"
        ) from exc
    status = response.status_code
    if status == 200:
        return response
    if status == 404:
        raise HubLookupFailed(
            f"the Hugging Face hub at {endpoint} has no {what} (404): check the name and revision; a private repo "
            "needs HF_TOKEN set for the control plane"
        )
    if status in (401, 403):
        raise HubLookupFailed(
            f"the Hugging Face hub at {endpoint} refused {what} ({status}): it is gated or private; set HF_TOKEN "
            "for the control plane to a token that can read it"
        )
    raise HubLookupFailed(f"the Hugging Face hub at {endpoint} failed on {what} ({status}): try again later")


def _malformed(hub: HubSettings, problem: str) -> str:
    return (
        f"the Hugging Face hub at {endpoint_of(hub)} answered in a form Flotilla does not know ({problem}): "
        "is HF_ENDPOINT a Hugging Face hub or mirror?"
    )
