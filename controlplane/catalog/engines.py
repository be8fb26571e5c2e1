"""The engines a pipeline's workers may run (the ``out=`` of ``flotilla run``), and what each needs."""

from django.db import models


class Engine(models.TextChoices):
    MOCKER = "mocker", "mocker (simulated vLLM, no weights)"
    LLAMACPP = "llamacpp", "llama.cpp (GGUF)"
    MISTRALRS = "mistralrs", "mistral.rs"
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
    TRTLLM = "trtllm", "TensorRT-LLM"
    ECHO_CORE = "echo_core", "echo (tokens)"
    ECHO_FULL = "echo_full", "echo (text)"


# These run only on a GPU: a worker group of theirs needs at least one GPU per replica.
GPU_ONLY_ENGINES = frozenset({Engine.VLLM, Engine.SGLANG, Engine.TRTLLM})
# llama.cpp loads GGUF files only.
GGUF_ONLY_ENGINES = frozenset({Engine.LLAMACPP})
