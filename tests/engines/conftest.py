"""Fixtures of the engine tests."""

from pathlib import Path

import pytest

from tests.engines.vllm_model import smollm2_safetensors


@pytest.fixture(scope="session")
def vllm_model_folder() -> Path:
    """SmolLM2 as the safetensors folder vLLM loads (converted from the test GGUF on first use)."""
    return smollm2_safetensors()
