"""A tiny random-weight multimodal projector for SmolLM2, as llama.cpp's mtmd library loads them (an "mmproj" GGUF).

No vision GGUF can be had from the package index (the only one these machines reach), so the tests write one: a
LLaVA-style projector (``clip.projector_type`` "mlp": a CLIP vision transformer, then two linear layers into the
text model's embedding width), with the key and tensor names of llama.cpp's ``tools/mtmd/clip-impl.h`` and the
shapes its ``clip.cpp`` loads and ``models/llava.cpp`` computes with. Its weights are random, so the model's
answers about an image are noise; what the tests check is that the image is encoded and fed where its
placeholder stands (two images give two answers, the same image the same answer), not what the model sees.

The image is resized to ``IMAGE_SIZE`` square and cut into ``(IMAGE_SIZE / PATCH_SIZE) ** 2`` patches, each one
token of the prompt: ``IMAGE_TOKENS`` per image, whatever its size.
"""

from pathlib import Path

import gguf
import numpy as np

IMAGE_SIZE = 32
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
#: The vision transformer's width, heads, feed-forward width and layers (LLaVA's projector reads the output of
#: the second-to-last layer, so two layers run one).
_WIDTH, _HEADS, _FFN, _LAYERS = 32, 2, 64, 2
_HIDDEN = 64  # the projector's inner width


def write_projector(path: Path, *, text_width: int = 576, seed: int = 0) -> Path:
    """Write the projector to ``path`` for a text model whose embeddings are ``text_width`` wide (SmolLM2-135M's
    576) and return ``path``."""
    rng = np.random.default_rng(seed)

    def weights(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.name", "flotilla-tiny-projector")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", _WIDTH)
    writer.add_uint32("clip.vision.feed_forward_length", _FFN)
    writer.add_uint32("clip.vision.projection_dim", text_width)
    writer.add_uint32("clip.vision.block_count", _LAYERS)
    writer.add_uint32("clip.vision.attention.head_count", _HEADS)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    # numpy shapes are ggml's dimensions reversed: a (rows, columns) matrix maps columns-wide inputs to rows.
    writer.add_tensor("v.patch_embd.weight", weights(_WIDTH, 3, PATCH_SIZE, PATCH_SIZE).astype(np.float16))
    writer.add_tensor("v.position_embd.weight", weights(IMAGE_TOKENS, _WIDTH))
    writer.add_tensor("v.pre_ln.weight", np.ones(_WIDTH, np.float32))
    writer.add_tensor("v.pre_ln.bias", np.zeros(_WIDTH, np.float32))
    for layer in range(_LAYERS):
        block = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{block}.{name}.weight", weights(_WIDTH, _WIDTH))
            writer.add_tensor(f"{block}.{name}.bias", weights(_WIDTH, scale=0.02))
        for norm in ("ln1", "ln2"):
            writer.add_tensor(f"{block}.{norm}.weight", np.ones(_WIDTH, np.float32))
            writer.add_tensor(f"{block}.{norm}.bias", np.zeros(_WIDTH, np.float32))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(_FFN, _WIDTH))
        writer.add_tensor(f"{block}.ffn_up.bias", weights(_FFN, scale=0.02))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(_WIDTH, _FFN))
        writer.add_tensor(f"{block}.ffn_down.bias", weights(_WIDTH, scale=0.02))
    writer.add_tensor("mm.0.weight", weights(_HIDDEN, _WIDTH))
    writer.add_tensor("mm.0.bias", weights(_HIDDEN, scale=0.02))
    # Large enough that two images steer SmolLM2's greedy answer apart (0.05 did not), small enough for sane text.
    writer.add_tensor("mm.2.weight", weights(text_width, _HIDDEN, scale=0.3))
    writer.add_tensor("mm.2.bias", np.zeros(text_width, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
