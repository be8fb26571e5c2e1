"""Model cards are built from a GGUF file's metadata or from a Hugging Face model folder."""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import ConfigError, ModelError
from runtime.models.card import ModelCard
from runtime.models.loading import default_model_name, load_model_card

FOLDER_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data))


@pytest.fixture
def hf_folder(tmp_path: Path, smollm2_card: ModelCard) -> Path:
    """A Hugging Face style folder made from SmolLM2's GGUF tokenizer (no weights: cards need none)."""
    folder = tmp_path / "SmolLM2-folder"
    folder.mkdir()
    assert smollm2_card.tokenizer_json is not None
    (folder / "tokenizer.json").write_text(smollm2_card.tokenizer_json)
    _write_json(
        folder / "tokenizer_config.json",
        {
            "chat_template": FOLDER_TEMPLATE,
            "bos_token": "<|im_start|>",
            "eos_token": {"content": "<|im_end|>", "special": True},
            "model_max_length": 1000000000000000019884624838656,
        },
    )
    _write_json(folder / "config.json", {"max_position_embeddings": 2048, "eos_token_id": 0})
    _write_json(folder / "generation_config.json", {"eos_token_id": [2, 0]})
    return folder


def test_gguf_card_has_smollm2s_context_stop_ids_and_name(smollm2: Path, smollm2_card: ModelCard) -> None:
    assert smollm2_card.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2_card.context_length == 8192
    assert 2 in smollm2_card.eos_token_ids
    assert smollm2_card.bos_token == "<|im_start|>"
    assert smollm2_card.eos_token == "<|im_end|>"
    assert smollm2_card.chat_template is not None and "<|im_start|>" in smollm2_card.chat_template
    assert smollm2_card.source == str(smollm2)
    assert smollm2_card.tokenizer.encode("<|im_end|>", add_special_tokens=False).ids == [2]


def test_a_smaller_context_length_caps_the_models(smollm2: Path) -> None:
    assert load_model_card(smollm2, context_length=4096, name="small").context_length == 4096
    assert load_model_card(smollm2, context_length=100_000).context_length == 8192


@pytest.mark.parametrize("context_length", [0, -1])
def test_a_context_length_below_one_is_a_config_error(smollm2: Path, context_length: int) -> None:
    with pytest.raises(ConfigError, match="context length"):
        load_model_card(smollm2, context_length=context_length)


def test_a_hugging_face_folder_loads(hf_folder: Path, smollm2_card: ModelCard) -> None:
    card = load_model_card(hf_folder)
    assert card.name == "SmolLM2-folder"
    assert card.context_length == 2048
    assert card.eos_token_ids == [2, 0]
    assert card.bos_token == "<|im_start|>"
    assert card.eos_token == "<|im_end|>"
    assert card.chat_template == FOLDER_TEMPLATE
    assert card.source == str(hf_folder)
    assert card.template is not None
    assert card.template.render([{"role": "user", "content": "hi"}]) == "[user] hi<|im_end|>"
    text = "<|im_start|>user\n12345 😀<|im_end|>"
    assert card.tokenizer.encode(text).ids == smollm2_card.tokenizer.encode(text).ids


def test_chat_template_jinja_wins_over_tokenizer_config(hf_folder: Path) -> None:
    (hf_folder / "chat_template.jinja").write_text("{{ messages | length }}")
    assert load_model_card(hf_folder).chat_template == "{{ messages | length }}"


def test_a_named_default_template_is_picked_from_a_list(hf_folder: Path) -> None:
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    _write_json(hf_folder / "tokenizer_config.json", config)
    assert load_model_card(hf_folder).chat_template == "plain"


def test_context_length_falls_back_to_a_sane_model_max_length(hf_folder: Path) -> None:
    _write_json(hf_folder / "config.json", {})
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    with pytest.raises(ModelError, match="pass --context-length"):
        load_model_card(hf_folder)  # model_max_length is transformers' 1e30 "no limit"
    assert load_model_card(hf_folder, context_length=512).context_length == 512
    _write_json(hf_folder / "tokenizer_config.json", {**config, "model_max_length": 4096})
    assert load_model_card(hf_folder).context_length == 4096


def test_context_length_is_read_from_text_config_of_multimodal_models(hf_folder: Path) -> None:
    _write_json(hf_folder / "config.json", {"text_config": {"max_position_embeddings": 32768}})
    assert load_model_card(hf_folder).context_length == 32768


def test_a_hugging_face_cache_snapshot_is_named_after_its_repo(hf_folder: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "0123abcd"
    shutil.copytree(hf_folder, snapshot)
    assert load_model_card(snapshot).name == "SmolLM2-135M-Instruct"
    assert default_model_name(snapshot) == "SmolLM2-135M-Instruct"


def test_model_config_overrides_the_ggufs_tokenizer_and_template(smollm2: Path, hf_folder: Path) -> None:
    card = load_model_card(smollm2, model_config=hf_folder, name="override")
    assert card.name == "override"
    assert card.chat_template == FOLDER_TEMPLATE
    assert card.eos_token_ids == [2, 0]
    assert card.context_length == 8192  # still the weights' own
    assert card.source == str(smollm2)


def test_a_missing_path_is_a_model_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelError, match=r"nope\.gguf"):
        load_model_card(missing)


def test_a_file_that_is_not_gguf_is_a_model_error_naming_it(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelError, match=r"weights\.gguf"):
        load_model_card(bogus)


def test_a_folder_without_tokenizer_json_is_a_model_error(hf_folder: Path) -> None:
    (hf_folder / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"has no tokenizer\.json"):
        load_model_card(hf_folder)


def test_a_corrupt_config_file_is_a_model_error_naming_it(hf_folder: Path) -> None:
    (hf_folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"tokenizer_config\.json"):
        load_model_card(hf_folder)


def test_a_model_config_that_is_not_a_folder_is_a_model_error(smollm2: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="is not a folder"):
        load_model_card(smollm2, model_config=tmp_path / "missing")


def test_gemma_card_comes_from_its_sentencepiece_gguf(gemma_gguf: Path) -> None:
    card = load_model_card(gemma_gguf)
    assert card.context_length == 32768
    assert card.eos_token == "<eos>"
    assert card.eos_token_ids[0] == 1
    assert 106 in card.eos_token_ids  # <end_of_turn>
    assert card.chat_template is None  # a base model
    assert card.tokenizer.encode("Hello world").ids == [2, 9259, 1902]
