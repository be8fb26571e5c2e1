"""Build a model card from the files of a model: a GGUF file, or a Hugging Face model folder.

A GGUF file carries everything in its metadata (tokenizer, chat template, special tokens, context
length). A Hugging Face folder spreads it over ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``generation_config.json`` and ``config.json``. ``--model-config`` names a
folder whose tokenizer and chat template replace the model's own, e.g. for a GGUF whose embedded
template is wrong.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from runtime.errors import ConfigError, ModelError
from runtime.models.card import ModelCard
from runtime.models.tokenizer import gguf_metadata, gguf_tokenizer, open_gguf, tokenizer_from_file

# transformers' "no limit" sentinel for model_max_length is 1e30; anything this large is no answer.
_MAX_SANE_CONTEXT = 10_000_000
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


@dataclass
class _Processing:
    """The pre/post-processing half of a card, from whichever files provide it."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)


def load_model_card(
    model_path: Path,
    *,
    model_config: Path | None = None,
    name: str | None = None,
    context_length: int | None = None,
) -> ModelCard:
    """Return the card of the model at ``model_path`` (a GGUF file or a Hugging Face folder).

    ``model_config`` is a folder whose tokenizer and chat template are used instead of the model's;
    ``name`` defaults to the file stem, the folder name, or the repo name of a Hugging Face cache
    snapshot; ``context_length`` caps the model's own. Raises ConfigError for a context length below 1
    and ModelError, naming the path, for missing or unreadable files.
    """
    if context_length is not None and context_length <= 0:
        raise ConfigError(f"context length must be at least 1, not {context_length}")
    if model_config is not None and not model_config.is_dir():
        raise ModelError(f"model config {str(model_config)!r} is not a folder")
    if model_path.is_file():
        reader = open_gguf(model_path)
        meta = gguf_metadata(reader)
        model_context = meta.context_length
        if model_config is not None:
            processing = _folder_processing(model_config)
            model_context = model_context or _folder_context_length(model_config)
        else:
            processing = _Processing(
                tokenizer=gguf_tokenizer(reader),
                chat_template=meta.chat_template,
                bos_token=meta.bos_token,
                eos_token=meta.eos_token,
                eos_token_ids=meta.eos_token_ids,
            )
    elif model_path.is_dir():
        processing = _folder_processing(model_config or model_path)
        model_context = _folder_context_length(model_path)
        if model_context is None and model_config is not None:
            model_context = _folder_context_length(model_config)
    else:
        raise ModelError(f"model {str(model_path)!r} does not exist")
    card = ModelCard(
        name=name or default_model_name(model_path),
        context_length=_cap_context(model_path, model_context, context_length),
        eos_token_ids=processing.eos_token_ids,
        bos_token=processing.bos_token,
        eos_token=processing.eos_token,
        chat_template=processing.chat_template,
        tokenizer_json=processing.tokenizer.to_str(),
        source=str(model_path),
    )
    # The tokenizer just built is the card's: building it again from the JSON would cost ~60 ms.
    card.__dict__["tokenizer"] = processing.tokenizer
    return card


def default_model_name(model_path: Path) -> str:
    """Name a model after its file stem, its folder, or its repo when in the Hugging Face cache."""
    if model_path.is_file():
        return model_path.stem
    # The hub cache lays repos out as models--{org}--{name}/snapshots/{revision}; repo names have no "--".
    snapshots = model_path.parent
    repo_folder = snapshots.parent.name
    if snapshots.name == "snapshots" and repo_folder.startswith("models--") and repo_folder.count("--") >= 2:
        return repo_folder.split("--", 2)[2]
    return model_path.name or str(model_path)


def _cap_context(model_path: Path, model_context: int | None, requested: int | None) -> int:
    if model_context is None or model_context <= 0:
        if requested is None:
            raise ModelError(
                f"cannot tell the context length of {str(model_path)!r} from its files; pass --context-length"
            )
        return requested
    return model_context if requested is None else min(model_context, requested)


def _read_json(path: Path) -> dict[str, Any] | None:
    """Return a JSON object file's contents, None when it does not exist; ModelError when unreadable."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{str(path)!r} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{str(path)!r} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """``bos_token``/``eos_token`` in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """Find the chat template the way transformers does: chat_template.jinja first, then the configs."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelError(f"{str(jinja)!r} cannot be read: {exc}") from exc
    template = tokenizer_config.get("chat_template")
    if template is None:
        template = (_read_json(folder / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):
        # Several named templates ({"name", "template"}); requests without tools use "default".
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _folder_processing(folder: Path) -> _Processing:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelError(
            f"folder {str(folder)!r} has no tokenizer.json (a slow-tokenizer-only model is not supported); "
            "pass --model-config with a folder that has one"
        )
    tokenizer = tokenizer_from_file(tokenizer_file)
    tokenizer_config = _read_json(folder / "tokenizer_config.json") or {}
    bos_token = _token_text(tokenizer_config.get("bos_token"))
    eos_token = _token_text(tokenizer_config.get("eos_token"))
    eos_ids: list[int] = []
    eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
    candidates = [
        *([] if eos_id is None else [eos_id]),
        *_ids((_read_json(folder / "generation_config.json") or {}).get("eos_token_id")),
        *_ids((_read_json(folder / "config.json") or {}).get("eos_token_id")),
    ]
    for token_id in candidates:
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    return _Processing(
        tokenizer=tokenizer,
        chat_template=_chat_template(folder, tokenizer_config),
        bos_token=bos_token,
        eos_token=eos_token,
        eos_token_ids=eos_ids,
    )


def _folder_context_length(folder: Path) -> int | None:
    config = _read_json(folder / "config.json") or {}
    # Multimodal models keep the language model's settings under text_config.
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            for key in _CONTEXT_KEYS:
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    tokenizer_config = _read_json(folder / "tokenizer_config.json") or {}
    max_length = tokenizer_config.get("model_max_length")
    if isinstance(max_length, int | float) and 0 < max_length < _MAX_SANE_CONTEXT:
        return int(max_length)
    return None
