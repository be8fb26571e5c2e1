"""A tokenizer rebuilt from a GGUF file's metadata gives exactly llama.cpp's token ids."""

from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer

from runtime.errors import ModelError
from runtime.models.tokenizer import GGUFFile, gguf_metadata, gguf_tokenizer, open_gguf, tokenizer_from_file

TRICKY = [
    "",
    " ",
    "Hello world! 123",
    "12345",
    "3.14159 and 1,000,000",
    "   three leading spaces",
    "trailing spaces   ",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦",
    "日本語のテキスト、中文文本，한국어",
    "def f(x):\n\treturn x  # comment\n\n\n    if x:\n        pass\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you're right, we've seen they'll say he'd go; IT'S LOUD",
    "Ünïcödé çàfé naïve Straße",
    "a\r\nb\r\n\r\n",
    "tabs\t\tand\t spaces \t",
    "<|endoftext|><|im_end|>",
    "<|im_start|<|im_start|><|im_start|> <|im_start|> ",
    'html <div class="x">&amp;</div> <table><tr><td>1</td></tr></table>',
    "Привет, мир! مرحبا بالعالم नमस्ते ภาษาไทย",
    "\u00a0nbsp\u2003emsp\u3000ideographic zero\u200bwidth",
    "e=mc² ½ ⅓ Ⅻ ١٢٣ x² 0x1F",
    "Visit https://example.com/path?q=1&r=2#frag",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<0x41> is not a byte token in text",
    "a" * 300,
]


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.llamacpp
@pytest.mark.parametrize("text", TRICKY)
def test_smollm2_ids_equal_llama_cpp_ids(text: str, smollm2_tokenizer: Tokenizer, smollm2_llama: Any) -> None:
    expected = smollm2_llama.tokenize(text.encode(), add_bos=False, special=True)
    assert _ids(smollm2_tokenizer, text) == expected


@pytest.mark.llamacpp
@pytest.mark.parametrize("text", TRICKY)
def test_gemma_sentencepiece_ids_equal_llama_cpp_ids(text: str, gemma_tokenizer: Tokenizer, gemma_llama: Any) -> None:
    expected = gemma_llama.tokenize(text.encode(), add_bos=False, special=True)
    assert _ids(gemma_tokenizer, text) == expected


@pytest.mark.llamacpp
def test_smollm2_bos_is_added_exactly_as_llama_cpp_adds_it(smollm2_tokenizer: Tokenizer, smollm2_llama: Any) -> None:
    assert smollm2_tokenizer.encode("Hi").ids == smollm2_llama.tokenize(b"Hi", add_bos=True, special=True)


@pytest.mark.llamacpp
def test_gemma_bos_is_added_exactly_as_llama_cpp_adds_it(gemma_tokenizer: Tokenizer, gemma_llama: Any) -> None:
    assert gemma_tokenizer.encode("Hi").ids == gemma_llama.tokenize(b"Hi", add_bos=True, special=True)


def test_chat_markers_encode_to_single_ids(smollm2_tokenizer: Tokenizer) -> None:
    assert _ids(smollm2_tokenizer, "<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert _ids(smollm2_tokenizer, "<|endoftext|>") == [0]


def test_smollm2_splits_digits_one_by_one(smollm2_tokenizer: Tokenizer) -> None:
    assert _ids(smollm2_tokenizer, "12345") == [33, 34, 35, 36, 37]


def test_smollm2_adds_no_bos_because_its_gguf_says_so(smollm2_tokenizer: Tokenizer) -> None:
    assert smollm2_tokenizer.encode("hi").ids == _ids(smollm2_tokenizer, "hi")


def test_gemma_adds_bos_because_its_gguf_says_so(gemma_tokenizer: Tokenizer) -> None:
    assert gemma_tokenizer.encode("hi").ids[0] == 2
    assert gemma_tokenizer.encode("hi").ids[1:] == _ids(gemma_tokenizer, "hi")


@pytest.mark.parametrize("text", TRICKY)
def test_decoding_gives_back_the_text(text: str, smollm2_tokenizer: Tokenizer) -> None:
    assert smollm2_tokenizer.decode(_ids(smollm2_tokenizer, text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TRICKY)
def test_gemma_decoding_gives_back_the_text(text: str, gemma_tokenizer: Tokenizer) -> None:
    assert gemma_tokenizer.decode(_ids(gemma_tokenizer, text), skip_special_tokens=False) == text


def test_decoding_skips_control_tokens_but_keeps_user_defined_ones(gemma_tokenizer: Tokenizer) -> None:
    ids = _ids(gemma_tokenizer, "<start_of_turn>a  b\n\nc<end_of_turn>")
    assert gemma_tokenizer.decode(ids) == "a  b\n\nc"


def test_serialized_tokenizer_gives_the_same_ids(smollm2_tokenizer: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(smollm2_tokenizer.to_str())
    reloaded = tokenizer_from_file(tmp_path / "tokenizer.json")
    for text in TRICKY:
        assert _ids(reloaded, text) == _ids(smollm2_tokenizer, text)


def test_metadata_reads_as_ggufs_own_reader_reads_it(smollm2: Path, smollm2_gguf: GGUFFile) -> None:
    reference = gguf.GGUFReader(smollm2)
    expected = {key: f.contents() for key, f in reference.fields.items() if not key.startswith("GGUF.")}
    assert smollm2_gguf.values == expected


def test_smollm2_metadata_has_its_special_tokens_and_stop_ids(smollm2_gguf: GGUFFile) -> None:
    meta = gguf_metadata(smollm2_gguf)
    assert (meta.architecture, meta.context_length) == ("llama", 8192)
    assert (meta.bos_token_id, meta.bos_token) == (1, "<|im_start|>")
    assert (meta.eos_token_id, meta.eos_token) == (2, "<|im_end|>")
    assert meta.eos_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|> which llama.cpp also stops on
    assert meta.chat_template is not None and meta.chat_template.startswith("{% for message in messages %}")


def _write_gguf(path: Path, model: str, tokens: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(64)
    writer.add_tokenizer_model(model)
    if tokens:
        writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_tokenizer_model_is_a_model_error(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a"])
    with pytest.raises(ModelError, match=r"tokenizer model 'bert' .* is not supported"):
        gguf_tokenizer(open_gguf(path))


def test_a_gguf_without_a_vocabulary_is_a_model_error(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "empty.gguf", "gpt2", [])
    with pytest.raises(ModelError, match="has no tokenizer vocabulary"):
        gguf_tokenizer(open_gguf(path))


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00\x00"])
def test_a_file_that_is_not_gguf_is_a_model_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError, match=r"model\.gguf' is not a readable GGUF file"):
        open_gguf(path)


def test_a_truncated_gguf_is_a_model_error(smollm2: Path, tmp_path: Path) -> None:
    path = tmp_path / "truncated.gguf"
    path.write_bytes(smollm2.read_bytes()[:100_000])  # the vocabulary is cut off
    with pytest.raises(ModelError, match="is not a readable GGUF file"):
        open_gguf(path)


def test_a_broken_tokenizer_json_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(ModelError, match="cannot be loaded"):
        tokenizer_from_file(tmp_path / "tokenizer.json")
