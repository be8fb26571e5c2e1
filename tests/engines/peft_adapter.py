"""A tiny PEFT LoRA adapter for a Llama-shaped model (SmolLM2 here), written with torch and safetensors (vLLM's
venv has both): rank ``rank`` on ``q_proj`` and ``v_proj`` of every layer, random weights with ``lora_B`` nonzero
(PEFT starts B at zero, which would change nothing), so a greedy answer with it differs from the base model's."""

import json
from pathlib import Path


def write_peft_adapter(model_folder: Path, out: Path, *, rank: int = 8, seed: int = 0, scale: float = 0.2) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out`` for the model in
    ``model_folder`` (its ``config.json`` gives the shapes); returns ``out``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_folder / "config.json").read_text())
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    outputs = {
        "q_proj": int(config["num_attention_heads"]) * head_dim,
        "v_proj": int(config.get("num_key_value_heads", config["num_attention_heads"])) * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, width in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width, rank, generator=generator) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_folder),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(outputs),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out
