"""Whether a Hugging Face folder served by vLLM is a vision model, from its ``config.json`` (vLLM not imported).

A multimodal model's config has a ``vision_config`` and names the placeholder token its chat template writes
for an image (``image_token_index``, LLaVA's; ``image_token_id``, Qwen2-VL's and others'). vLLM widens each
placeholder to the image's features: for LLaVA the count is fixed by the vision tower, ``(image_size //
patch_size) ** 2`` (one more with ``vision_feature_select_strategy: full``, which keeps the class token), as
vLLM's ``LlavaProcessingInfo`` counts them; for the others it depends on each image's size, and the gateway
leaves it to vLLM (``ModelCard.image_tokens`` None).
"""

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Model types whose image token count the gateway can tell from the config alone.
_FIXED_GRID = frozenset({"llava"})


def vision_fields(folder: Path) -> dict[str, Any]:
    """The card's ``vision``, ``image_token_id`` and ``image_tokens`` for the model in ``folder``; empty for a
    text model (or a config that cannot be read: vLLM will say what is wrong with it as it loads)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return {}
    token = config.get("image_token_index", config.get("image_token_id"))
    if type(token) is not int:
        log.warning("%s has a vision tower but names no image token in config.json: serving it text only", folder)
        return {}
    return {"vision": True, "image_token_id": token, "image_tokens": _image_tokens(config)}


def _image_tokens(config: dict[str, Any]) -> int | None:
    vision = config["vision_config"]
    size, patch = vision.get("image_size"), vision.get("patch_size")
    if config.get("model_type") not in _FIXED_GRID or type(size) is not int or type(patch) is not int or patch < 1:
        return None
    grid = (size // patch) ** 2
    return grid + 1 if config.get("vision_feature_select_strategy") == "full" else grid
