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
