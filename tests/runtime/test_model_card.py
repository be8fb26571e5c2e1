"""The model card's derived objects: built once, ready before serving, errors in our hierarchy."""

import msgspec
import pytest

from runtime.errors import ModelError
from runtime.models.card import ModelCard


def test_the_longest_token_is_the_vocabulary_s_longest(smollm2_card: ModelCard) -> None:
    fresh = msgspec.structs.replace(smollm2_card)
    expected = max(map(len, fresh.tokenizer.get_vocab(with_added_tokens=True)))
    assert fresh.max_token_chars == expected


def test_prepare_uses_a_tokenizer_built_before(smollm2_card: ModelCard) -> None:
    kept = smollm2_card.tokenizer
    card = msgspec.structs.replace(smollm2_card).prepare(kept)
    assert card.tokenizer is kept
    assert card.template is not None


def test_a_malformed_tokenizer_is_a_model_error() -> None:
    card = ModelCard(name="broken", context_length=16, tokenizer_json='{"not": "a tokenizer"}')
    with pytest.raises(ModelError, match="the tokenizer of model 'broken' cannot be loaded"):
        card.prepare()


def test_a_loaded_card_keeps_the_tokenizer_it_was_read_with_and_it_tokenizes_as_one_rebuilt_from_the_json(
    smollm2_card: ModelCard,
) -> None:
    """A worker uses the tokenizer built while reading the GGUF; an ingress builds one from the card's JSON."""
    kept = smollm2_card.__dict__.get("tokenizer")
    assert kept is not None  # built while loading, not again on first use
    rebuilt = msgspec.structs.replace(smollm2_card).tokenizer
    assert rebuilt is not kept
    text = "<|im_start|>user\nHéllo, wörld! 🚀 12345\tcode: def f(x): return x**2<|im_end|>"
    for special in (False, True):
        assert kept.encode(text, add_special_tokens=special).ids == rebuilt.encode(text, add_special_tokens=special).ids
    ids = rebuilt.encode(text).ids
    assert kept.decode(ids, skip_special_tokens=False) == rebuilt.decode(ids, skip_special_tokens=False)


def test_replace_keeps_what_was_built_from_unchanged_fields_and_rebuilds_the_rest(smollm2_card: ModelCard) -> None:
    card = msgspec.structs.replace(smollm2_card).prepare()
    changed = card.replace(kv_cache_block_size=64, name="other")
    assert (changed.kv_cache_block_size, changed.name) == (64, "other")
    assert changed.tokenizer is card.tokenizer and changed.template is card.template
    assert changed.max_token_chars == card.max_token_chars
    retemplated = card.replace(chat_template="{{ messages[0]['content'] }}")
    assert retemplated.tokenizer is card.tokenizer and retemplated.template is not card.template
    assert "max_token_chars" in retemplated.__dict__
    assert card.replace(tokenizer_json=card.tokenizer_json).tokenizer is not card.tokenizer
