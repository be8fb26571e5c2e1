"""A tiny LoRA GGUF for a GGUF model (the test SmolLM2), written with the ``gguf`` package as llama.cpp's
convert_lora_to_gguf.py writes one: ``general.type`` "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``,
the model's ``general.architecture``, and for each adapted weight ``W`` (ggml shape ``[n_in, n_out]``) the tensors
``W.lora_a`` (``[n_in, rank]``) and ``W.lora_b`` (``[rank, n_out]``), float32, random: ``lora_b`` nonzero so that
the answers change (llama.cpp's llama-adapter.cpp checks these shapes against the model's)."""

from pathlib import Path

MODULES = ("attn_q", "attn_v")


def write_gguf_lora(model: Path, out: Path, *, rank: int = 8, seed: int = 0, scale: float = 0.2) -> Path:
    """Write a LoRA GGUF for ``model`` into ``out`` (rank ``rank`` on attn_q and attn_v of every layer)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(model))
    architecture = str(reader.fields["general.architecture"].contents())
    shapes = {
        tensor.name: [int(size) for size in tensor.shape]
        for tensor in reader.tensors
        if tensor.name.endswith(".weight") and tensor.name.split(".")[-2] in MODULES
    }
    generator = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(2 * rank))
    for name, (n_in, n_out) in sorted(shapes.items()):
        # numpy's shapes are ggml's reversed.
        lora_a = (generator.standard_normal((rank, n_in)) * scale).astype(np.float32)
        lora_b = (generator.standard_normal((n_out, rank)) * scale).astype(np.float32)
        writer.add_tensor(f"{name}.lora_a", lora_a)
        writer.add_tensor(f"{name}.lora_b", lora_b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
