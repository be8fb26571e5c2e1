"""Downloads from the Hugging Face hub: which files of a repo to fetch, and errors that say what to do.

The one place for both: ``flotilla run`` (``download`` below, through runtime/models/source.py) and the
agent (agent/downloads.py, which adds its models folder, locks and progress) pick a repo's files with
``pick_files`` and turn huggingface_hub's exceptions into a ``HubError`` with ``hub_error``. What differs
between the two is a ``HubCaller``: whether a model may name a quantization tag (the command line's
llama.cpp-style shorthand), and the words of each remedy (``pass a local path`` or ``register the model
as a local path``).

A module of its own so that huggingface_hub (~0.35 s to import) is imported only when a model is
fetched from the hub, not by every worker that serves a local file.
"""

import enum
import errno
import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx2  # huggingface_hub's HTTP client; its transport errors mean the hub is unreachable
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from runtime.config import env_bool, env_float, env_str
from runtime.errors import ModelError, ModelUnreachable
from runtime.models.source import HF_FOLDER_FILES, HubModel

#: What makes a repo a PEFT (LoRA) adapter's folder.
ADAPTER_CONFIG = "adapter_config.json"

#: The GGUF quantization picked in a repo of several, as llama.cpp's ``-hf`` picks it.
DEFAULT_QUANT = "Q4_K_M"
# Weight formats a serving engine never loads when safetensors are there; Meta's "original/" holds a
# second copy of the weights as .pth.
SKIPPED_WITH_SAFETENSORS = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "original/*"]


@dataclass(frozen=True)
class HubSettings:
    """How to reach the hub; ``from_environment()`` reads huggingface_hub's own variables."""

    endpoint: str | None = None
    token: str | None = None
    offline: bool = False
    timeout_s: float = 10.0

    @classmethod
    def from_environment(cls) -> "HubSettings":
        """HF_ENDPOINT, HF_TOKEN (or HF_TOKEN_FILE), HF_HUB_OFFLINE, HF_HUB_ETAG_TIMEOUT. Raises ConfigError."""
        # Read when called, not at import: huggingface_hub freezes the environment when first imported.
        return cls(
            endpoint=env_str("HF_ENDPOINT") or None,
            token=env_str("HF_TOKEN") or None,
            offline=env_bool("HF_HUB_OFFLINE", False),
            timeout_s=env_float("HF_HUB_ETAG_TIMEOUT", 10.0, minimum=0.1),
        )


@dataclass(frozen=True)
class HubCaller:
    """Who fetches: what a model's ``file`` may be, and the words of the remedies its errors give."""

    #: Whether a ``file`` not ending in .gguf is a quantization tag (``org/name:Q8_0``), and a repo of
    #: several GGUF files gets its DEFAULT_QUANT one, as llama.cpp's ``-hf`` does. Otherwise ``file`` is
    #: a file name of the repo, and a repo of several GGUF files must have one named.
    quant_tags: bool
    #: How to serve without the hub: "pass a local path".
    local_path: str
    #: What holds the downloaded models: "the Hugging Face cache", or a folder.
    cache: str
    #: Whose environment HF_TOKEN and HF_HUB_OFFLINE are set in: "" or " for the agent".
    who: str = ""


class HubProblem(enum.Enum):
    """Why a model could not be fetched; each caller maps it onto its own errors."""

    UNREACHABLE = "unreachable"  # the hub did not answer, or failed (5xx): the same fetch may work later
    NOT_FOUND = "not found"  # no such repo (or private), revision or file
    UNAUTHORIZED = "unauthorized"  # gated, or refused to this token
    NOT_CACHED = "not cached"  # HF_HUB_OFFLINE is set and the cache lacks it
    DISK_FULL = "disk full"
    REFUSED = "refused"  # anything else the hub refused, or a repo that holds no model to serve


class HubError(ModelError):
    """A model could not be fetched from the Hugging Face hub; the message says what to do."""

    def __init__(self, problem: HubProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


class UnreachableHub(HubError, ModelUnreachable):
    """The hub did not answer, or failed: a supervisor should retry."""

    def __init__(self, message: str) -> None:
        super().__init__(HubProblem.UNREACHABLE, message)


@dataclass(frozen=True)
class RepoFiles:
    """What to fetch of a repo: ``file`` alone, or (``file`` None) a snapshot without what ``ignore`` matches."""

    names: list[str]  # the repo's files that will be fetched
    file: str | None = None
    ignore: list[str] | None = None


def pick_files(model: HubModel, files: Sequence[str], caller: HubCaller) -> RepoFiles:
    """What to fetch of ``model``'s repo, which holds ``files``. Raises HubError (NOT_FOUND or REFUSED).

    A named file is fetched alone. Otherwise a repo with config.json or tokenizer.json is a model folder (one with
    adapter_config.json a LoRA adapter's), fetched without its GGUF files (and without other weight formats when it
    has safetensors); a repo of one GGUF file gives that file; a repo of several needs one named, or a quantization
    tag (``caller.quant_tags``, DEFAULT_QUANT when none is given).
    """
    repo = model.repo_id
    wanted = model.file
    ggufs = [name for name in files if name.endswith(".gguf")]
    if wanted is not None and (wanted.endswith(".gguf") or not caller.quant_tags):
        if wanted not in files:
            listing = f"; its GGUF files: {_listing(ggufs)}" if wanted.endswith(".gguf") else ""
            raise HubError(
                HubProblem.NOT_FOUND,
                f"Hugging Face repo {repo!r}{_at(model.revision)} has no file {wanted!r}{listing}",
            )
        return RepoFiles([wanted], file=wanted)
    # A PEFT adapter's repo (adapter_config.json) is a folder too: a LoRA adapter is fetched as models are.
    if wanted is None and any(name in files for name in (*HF_FOLDER_FILES, ADAPTER_CONFIG)):
        ignore = ["*.gguf"]
        if any(name.endswith(".safetensors") for name in files):
            ignore += SKIPPED_WITH_SAFETENSORS
        # The same matching as huggingface_hub's own filter of ignore_patterns (fnmatch on the whole path).
        kept = [name for name in files if not any(fnmatch.fnmatch(name, pattern) for pattern in ignore)]
        return RepoFiles(kept, ignore=ignore)
    if not ggufs:
        raise HubError(
            HubProblem.REFUSED,
            f"Hugging Face repo {repo!r} has no config.json, tokenizer.json or .gguf file, so it is not a model "
            "Flotilla can run",
        )
    if wanted is None and len(ggufs) == 1:
        return RepoFiles(ggufs, file=ggufs[0])
    if not caller.quant_tags:
        raise HubError(
            HubProblem.REFUSED,
            f"Hugging Face repo {repo!r} holds {len(ggufs)} GGUF files: name the one to serve as the model's file "
            f"({_listing(ggufs)})",
        )
    tag = (wanted or DEFAULT_QUANT).lower()
    # Multimodal projectors ("mmproj-…") are not models; split files ("-00001-of-00003") need all parts.
    matches = [
        name
        for name in ggufs
        if tag in Path(name).name.lower() and "mmproj" not in name.lower() and not re.search(r"-of-\d+\.gguf$", name)
    ]
    if len(matches) == 1:
        return RepoFiles(matches, file=matches[0])
    raise HubError(
        HubProblem.REFUSED,
        f"Hugging Face repo {repo!r} has {len(ggufs)} GGUF files and {'none' if not matches else 'several'} match "
        f"{tag.upper()!r}: pick one with '{repo}:FILE.gguf' ({_listing(ggufs)})",
    )


def hub_error(exc: BaseException, model: HubModel, hub: HubSettings, caller: HubCaller) -> HubError | None:
    """The HubError that says what to do about ``exc``, raised fetching ``model``; None for a foreign failure."""
    repo = model.repo_id
    # GatedRepoError is a RepositoryNotFoundError, and every HfHubHTTPError is an OSError: order matters.
    if isinstance(exc, GatedRepoError):
        return HubError(
            HubProblem.UNAUTHORIZED,
            f"Hugging Face repo {repo!r} is gated: accept its terms on the hub, then set HF_TOKEN{caller.who} to a "
            "token of an account that has access",
        )
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            HubProblem.NOT_FOUND,
            f"Hugging Face repo {repo!r} does not exist or is private: check the name, or set HF_TOKEN{caller.who} "
            "to a token that can read it",
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(
            HubProblem.NOT_FOUND, f"Hugging Face repo {repo!r} has no revision {model.revision or 'main'!r}"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return HubError(HubProblem.NOT_FOUND, f"Hugging Face repo {repo!r}{_at(model.revision)} lacks a file: {exc}")
    if isinstance(exc, DisabledRepoError):
        return HubError(HubProblem.NOT_FOUND, f"Hugging Face repo {repo!r} has been disabled by its owner or the hub")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) and hub.offline:
        return HubError(
            HubProblem.NOT_CACHED,
            f"HF_HUB_OFFLINE is set and {str(model)!r}{_at(model.revision)} is not in {caller.cache}: put it there, "
            f"unset HF_HUB_OFFLINE to download it, or {caller.local_path}",
        )
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return HubError(
                HubProblem.UNAUTHORIZED,
                f"the Hugging Face hub refused {repo!r} ({status}): set HF_TOKEN{caller.who} to a token that can "
                "read it",
            )
        if status is not None and status >= 500:
            return UnreachableHub(f"the Hugging Face hub failed on {repo!r} ({status}); try again later")
        return HubError(HubProblem.REFUSED, f"the Hugging Face hub refused {str(model)!r}: {exc}")
    if isinstance(exc, (httpx2.TransportError, LocalEntryNotFoundError, OfflineModeIsEnabled)):
        # refused, reset, timed out, no DNS; huggingface_hub hides some of them behind LocalEntryNotFoundError
        cause = exc.__cause__ if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ else exc
        return UnreachableHub(
            f"cannot reach the Hugging Face hub at {hub.endpoint or 'https://huggingface.co'} "
            f"({type(cause).__name__}: {cause}); check the network (or HF_ENDPOINT), set HF_HUB_OFFLINE=1"
            f"{caller.who} to use only what {caller.cache} holds, or {caller.local_path}"
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return HubError(
            HubProblem.DISK_FULL,
            f"no space left in {caller.cache} while downloading {repo!r}: free some space and retry",
        )
    return None


def _at(revision: str | None) -> str:
    return f" at {revision!r}" if revision else ""


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, …" if len(names) > limit else shown or "none"


# -- `flotilla run` ------------------------------------------------------------------------------

#: The command line: ``org/name:Q8_0`` names a quantization, and the remedies speak to its user.
COMMAND_LINE = HubCaller(quant_tags=True, local_path="pass a local path", cache="the Hugging Face cache")


def download(hub_model: HubModel, *, cache_dir: Path | None = None, timeout: float = 10.0) -> Path:
    """Fetch ``hub_model`` into the Hugging Face cache (or find it there) and return its local path.

    Raises HubError (a ModelError) when the repo or file does not exist, access is refused or the hub
    cannot be reached (UnreachableHub, a ModelUnreachable), saying what to do about it.
    """
    hub = replace(HubSettings.from_environment(), timeout_s=timeout)
    try:
        if hub.offline:
            return _from_cache(hub_model, cache_dir)
        info = HfApi(endpoint=hub.endpoint, token=hub.token).model_info(hub_model.repo_id, timeout=timeout)
        plan = pick_files(hub_model, [sibling.rfilename for sibling in info.siblings or []], COMMAND_LINE)
        # Pin the revision model_info saw, so that every file comes from the same commit.
        if plan.file is not None:
            file = hf_hub_download(
                hub_model.repo_id,
                plan.file,
                revision=info.sha,
                cache_dir=cache_dir,
                endpoint=hub.endpoint,
                token=hub.token,
                etag_timeout=timeout,
            )
            return Path(file)
        folder = snapshot_download(
            hub_model.repo_id,
            revision=info.sha,
            ignore_patterns=plan.ignore,
            cache_dir=cache_dir,
            endpoint=hub.endpoint,
            token=hub.token,
            etag_timeout=timeout,
        )
        return Path(folder)
    except HubError:
        raise
    except Exception as exc:
        error = hub_error(exc, hub_model, hub, COMMAND_LINE)
        if error is None:
            raise
        raise error from exc


def _from_cache(hub_model: HubModel, cache_dir: Path | None) -> Path:
    if hub_model.file and hub_model.file.endswith(".gguf"):
        file = hf_hub_download(hub_model.repo_id, hub_model.file, cache_dir=cache_dir, local_files_only=True)
        return Path(file)
    if hub_model.file:
        raise HubError(
            HubProblem.REFUSED,
            f"with HF_HUB_OFFLINE set, name the GGUF file itself, not the tag in {str(hub_model)!r}",
        )
    folder = snapshot_download(hub_model.repo_id, cache_dir=cache_dir, local_files_only=True)
    return Path(folder)
