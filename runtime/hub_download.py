"""Downloads from the Hugging Face hub, with errors that say what to do (used by runtime/model_source.py).

A module of its own so that huggingface_hub (~0.35 s to import) is imported only when a model is
fetched from the hub, not by every worker that serves a local file.
"""

import os
import re
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

from runtime.config import env_bool, env_str
from runtime.errors import ModelError, ModelUnreachable
from runtime.model_source import HF_FOLDER_FILES, HubModel

#: The GGUF quantization picked in a repo of several, as llama.cpp's ``-hf`` picks it.
DEFAULT_QUANT = "Q4_K_M"
# Weight formats a serving engine never loads when safetensors are there; Meta's "original/" holds a
# second copy of the weights as .pth.
SKIPPED_WITH_SAFETENSORS = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "original/*"]


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
        ignore = SKIPPED_WITH_SAFETENSORS if any(f.endswith(".safetensors") for f in files) else []
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
    if wanted is None and any(f in files for f in HF_FOLDER_FILES):
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
