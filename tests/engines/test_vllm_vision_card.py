"""A vLLM model folder's config says whether the model takes images, and how many tokens a LLaVA image is."""

import json
from pathlib import Path
from typing import Any

import pytest

from engines.vllm.vision import vision_fields


def folder_with(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


LLAVA = {
    "model_type": "llava",
    "image_token_index": 32000,
    "vision_feature_select_strategy": "default",
    "vision_config": {"image_size": 336, "patch_size": 14},
}


def test_a_llava_image_is_its_vision_towers_patch_grid(tmp_path: Path) -> None:
    assert vision_fields(folder_with(tmp_path, LLAVA)) == {"vision": True, "image_token_id": 32000, "image_tokens": 576}


def test_the_full_strategy_keeps_the_class_token(tmp_path: Path) -> None:
    config = {**LLAVA, "vision_feature_select_strategy": "full"}
    assert vision_fields(folder_with(tmp_path, config))["image_tokens"] == 577


def test_a_model_whose_image_size_varies_leaves_the_count_to_the_engine(tmp_path: Path) -> None:
    config = {"model_type": "qwen2_vl", "image_token_id": 151655, "vision_config": {"patch_size": 14}}
    fields = vision_fields(folder_with(tmp_path, config))
    assert fields == {"vision": True, "image_token_id": 151655, "image_tokens": None}


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", "vocab_size": 49152},
        {"model_type": "llava", "vision_config": {"image_size": 336, "patch_size": 14}},  # no image token named
    ],
)
def test_a_text_model_or_one_without_an_image_token_is_text_only(tmp_path: Path, config: dict[str, Any]) -> None:
    assert vision_fields(folder_with(tmp_path, config)) == {}
