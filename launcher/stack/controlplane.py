"""What ``flotilla up`` asks of the control plane: its commands, its first accounts, and its REST API.

The launcher never imports Django: it runs the control plane's own ``manage.py`` (migrations, and the
account bootstrap, ``manage.py bootstrapaccounts``), then talks to its REST API like any client.
"""

import contextlib
import importlib.util
import json
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from controlplane.web_security import WebSecurity, relaxed
from runtime.errors import FlotillaError
from runtime.models.source import DEFAULT_MODEL_PACKAGE

ADMIN_USERNAME = "admin"
#: The node name of the agent ``flotilla up`` runs.
LOCAL_NODE = "local"
ADMIN_TOKEN_FILE = "admin.token"
AGENT_TOKEN_FILE = f"agent-{LOCAL_NODE}.token"
#: The admin's key for the OpenAI endpoint, made by the first `flotilla up` that needs one.
API_KEY_FILE = "api.key"
API_KEY_NAME = "flotilla up"

#: The control plane's command that makes sure of the accounts (controlplane/accounts/management/commands/).
BOOTSTRAP_COMMAND = "bootstrapaccounts"


class ControlPlaneError(FlotillaError):
    """The control plane refused or failed something ``flotilla up`` needs (the message says what)."""


def manage_command() -> list[str]:
    """How to run the control plane's ``manage.py``: the checkout's file when there is one, else Django's
    own entry point with the settings module named (an installed package has no manage.py)."""
    spec = importlib.util.find_spec("controlplane")
    if spec is not None and spec.origin is not None:
        manage = Path(spec.origin).parent.parent / "manage.py"
        if manage.is_file():
            return [sys.executable, str(manage)]
    return [sys.executable, "-m", "django"]


def bootstrap_command(data_dir: Path, *, api_key: bool = False) -> tuple[list[str], dict[str, str], str]:
    """The command that makes sure the admin and the tokens (and, with ``api_key``, the admin's API key) exist,
    the variables it reads (the secrets: never in its arguments, which anyone can read in ``ps``), and the
    password it gives a new admin (printed only if it says it created one).

    The command creates the admin only when there is none, and a new token (or key) only when the one kept in
    the data folder is not, or no longer, in the database, such as after a switch to another DATABASE_URL. It
    prints one JSON line (parse_bootstrap)."""
    password = secrets.token_urlsafe(12)
    argv = [*manage_command(), BOOTSTRAP_COMMAND, "--admin", ADMIN_USERNAME, "--node", LOCAL_NODE]
    env = {
        "FLOTILLA_UP_PASSWORD": password,
        "FLOTILLA_UP_ADMIN_TOKEN": read_secret(data_dir / ADMIN_TOKEN_FILE),
        "FLOTILLA_UP_AGENT_TOKEN": read_secret(data_dir / AGENT_TOKEN_FILE),
    }
    if api_key:
        argv += ["--api-key-name", API_KEY_NAME]
        env["FLOTILLA_UP_API_KEY"] = read_secret(data_dir / API_KEY_FILE)
    return argv, env, password


@dataclass(frozen=True)
class Bootstrap:
    """What the bootstrap did: whether it created the admin, and the tokens it had to create (None: kept)."""

    admin_created: bool
    admin_token: str | None
    agent_token: str | None
    api_key: str | None = None


def parse_bootstrap(output: str) -> Bootstrap:
    """The bootstrap's JSON line (the last line of its output). Raises ControlPlaneError when it is not there."""
    lines = output.strip().splitlines()
    try:
        data = json.loads(lines[-1])
        return Bootstrap(bool(data["admin_created"]), data["admin_token"], data["agent_token"], data.get("api_key"))
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        raise ControlPlaneError(f"the control plane's account bootstrap printed no result: {output[-500:]!r}") from exc


def development_notice(security: WebSecurity) -> str:
    """What ``flotilla up``'s control plane leaves off that a production one (deploy/systemd) has on, as lines
    to print; "" when it leaves nothing off (the variables set for a TLS proxy in front of it)."""
    off = relaxed(security)
    if not off:
        return ""
    items = "".join(f"\n    - {item}" for item in off)
    return (
        "  development web settings (plain HTTP on 127.0.0.1; production, deploy/systemd, has these on):"
        f"{items}\n    set the variables to turn them on, e.g. behind a TLS proxy (docs/operations.md)"
    )


def read_secret(path: Path) -> str:
    """The secret kept in ``path``, or "" when there is none."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def write_secret(path: Path, secret: str) -> None:
    """Write ``secret`` to ``path``, readable by its owner only (0600 from the start, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")
    os.replace(temporary, path)


@dataclass(frozen=True)
class FirstModel:
    """The model of the first pipeline: its catalog entry (name, where its files are) and engine."""

    name: str
    source_kind: str  # the catalog's: "gguf" (a file) or "folder"
    source: str
    engine: str


def local_model_roots(data_dir: Path, first_model: FirstModel | None, environ: Mapping[str, str] = os.environ) -> str:
    """``FLOTILLA_LOCAL_MODEL_ROOTS`` for the control plane of ``flotilla up``: the folders it would allow anyway
    (the variable's, else controlplane/catalog/local_roots.py's defaults: the data folder's models and the
    bundled model's folder) and the ``--model`` of the first pipeline, which may be anywhere."""
    configured = environ.get("FLOTILLA_LOCAL_MODEL_ROOTS", "").strip()
    if configured:
        roots = [configured]
    else:
        roots = [str(data_dir / "models")]
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is not None and spec.origin is not None:
            roots.append(str(Path(spec.origin).parent))
    if first_model is not None:
        roots.append(first_model.source)
    return ",".join(roots)


class ControlPlaneClient:
    """The few REST calls ``flotilla up`` makes, as the admin. Every method raises ControlPlaneError."""

    def __init__(self, base_url: str, token: str) -> None:
        self._client = httpx.AsyncClient(
            base_url=f"{base_url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=10.0
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(
        self, method: str, path: str, *, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None
    ) -> Any:
        try:
            response = await self._client.request(method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise ControlPlaneError(f"{method} /api/v1/{path} failed: {exc!r}") from exc
        if response.status_code >= 400:
            raise ControlPlaneError(f"{method} /api/v1/{path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    async def pipelines(self) -> list[dict[str, Any]]:
        """Every pipeline (the first page holds plenty for one machine)."""
        page = await self._call("GET", "pipelines/", params={"page_size": 500})
        return list(page["results"])

    async def deploy_first_pipeline(self, model: FirstModel) -> dict[str, Any]:
        """Add ``model`` to the catalog unless it is there by that name, then deploy one CPU replica of it."""
        found = await self._call("GET", "models/", params={"name": model.name})
        if not found["results"]:
            body = {
                "name": model.name,
                "source_kind": model.source_kind,
                "source": model.source,
                "engine": model.engine,
            }
            await self._call("POST", "models/", body=body)
        pipeline = {
            "name": model.name,
            "model": model.name,
            "groups": [{"engine": model.engine, "replicas": 1, "gpus_per_replica": 0}],
        }
        result: dict[str, Any] = await self._call("POST", "pipelines/", body=pipeline)
        return result

    async def repoint_first_model(self, model: FirstModel) -> str | None:
        """When the catalog's entry of ``model`` (by name) points at a local file or folder that is gone, and
        ``model.source`` is there (a data folder kept from a checkout since deleted, whose venv held the bundled
        model), point the entry at ``model.source`` and restart its pipelines' instances that failed for it.
        Returns the path it pointed at before, or None when nothing changed."""
        found = (await self._call("GET", "models/", params={"name": model.name}))["results"]
        if not found:
            return None
        entry = found[0]
        old = str(entry["source"])
        local = entry["source_kind"] in ("gguf", "folder") and entry["source_kind"] == model.source_kind
        if not local or old == model.source or _exists(old) or not _exists(model.source):
            return None
        await self._call("PATCH", f"models/{entry['id']}/", body={"source": model.source})
        # Those that failed for the old path, and those on their way to it (dispatched before the change).
        instances = (await self._call("GET", "instances/", params={"page_size": 500}))["results"]
        names = {p["name"] for p in await self.pipelines() if p["model"] == model.name}
        for instance in instances:
            if instance["pipeline_name"] in names and instance["state"] in ("failed", "downloading", "starting"):
                # One that moved on meanwhile is a Conflict: nothing to restart, which is fine.
                with contextlib.suppress(ControlPlaneError):
                    await self._call("POST", f"instances/{instance['id']}/restart/")
        return old

    async def progress(self, pipeline_names: list[str]) -> str:
        """One line on how far the instances of ``pipeline_names`` are (states, download progress, reasons)."""
        nodes = (await self._call("GET", "nodes/"))["results"]
        if not nodes:
            return "waiting for the local agent to register its node"
        instances = (await self._call("GET", "instances/", params={"page_size": 500}))["results"]
        mine = [instance for instance in instances if instance["pipeline_name"] in pipeline_names]
        if not mine:
            return "waiting for the reconciler to place the first instance"
        return "; ".join(_describe(instance) for instance in mine[:4])


def _exists(path: str) -> bool:
    """Whether a local model path is there (one stat: no need to leave the event loop)."""
    return Path(path).exists()


def _describe(instance: dict[str, Any]) -> str:
    state = str(instance["state"])
    text = f"{instance['pipeline_name']} #{instance['replica']}: {state}"
    if state == "downloading" and instance.get("download_progress") is not None:
        text += f" {float(instance['download_progress']):.0%}"
    if instance.get("reason") and state in ("pending", "failed"):
        text += f" ({str(instance['reason']).splitlines()[0][:160]})"
    return text
