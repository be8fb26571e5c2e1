"""How much memory one replica of a model needs, estimated from its files when the operator did not say.

The estimate (``estimate_memory_bytes``) is

    (weights + multimodal projector) on disk × 1.2  +  the KV cache of one sequence of the full context

* The factor 1.2 covers what an engine holds beside its weights: activations of a forward pass, the
  CUDA context and allocator slack (a few hundred MiB to a few GiB on a GPU). Quantized files (GGUF,
  AWQ) are counted at their size on disk, which is what they load as. A llama.cpp model's projector (its
  mmproj GGUF, often a fifth to a third of a quantized model's size) is loaded on the same GPU: it counts as
  weights once its size is known.
* The KV cache per token is 2 (keys and values) × layers × KV heads × head dimension × bytes per
  element, from the model's ``config.json`` (``num_hidden_layers``, ``num_key_value_heads`` or else
  ``num_attention_heads``, ``head_dim`` or else ``hidden_size / num_attention_heads``, ``torch_dtype``;
  in ``text_config`` for multimodal models). The context is the operator's ``context_length``, else the
  config's ``max_position_embeddings``. One full-context sequence is the least an engine must hold to
  serve its context at all; more concurrent sequences are the engine's own business within the GPU.
* Without a known weights size there is no estimate (None), and placement gives each GPU replica whole
  GPUs. A model served by an engine that loads no weights (the mocker, echo: ``WEIGHTLESS_ENGINES``) gets
  none either (catalog/actions.py): its files' size says nothing of what its replicas hold. Without a
  config (a GGUF file, a repo the control plane cannot read) the KV part is left out.

``read_local_model`` finds the size and config of a local source when this machine can see it (the
one-machine setup); otherwise the operator gives ``size_bytes`` and ``config``, or agents' downloads
report the size.
"""

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.catalog.local_roots import under_roots

WEIGHTS_FACTOR = 1.2
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The keys of config.json the estimate reads: what the catalog keeps of a model's config.
CONFIG_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "max_position_embeddings",
    "torch_dtype",
)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "float8_e4m3fn": 1, "int8": 1}
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class KvShape:
    """What one token's KV cache is made of."""

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int = 2

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element


@dataclass(frozen=True, slots=True)
class LocalModelFiles:
    """A local model as this machine sees it: its weights' size, and its config when it has one."""

    size_bytes: int
    config: dict[str, Any]


def kv_shape(config: Mapping[str, Any]) -> KvShape | None:
    """The KV shape a ``config.json`` describes, or None when it lacks what is needed."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping) and "num_hidden_layers" not in config:
        config = {**config, **nested}
    layers = _positive_int(config.get("num_hidden_layers"))
    heads = _positive_int(config.get("num_attention_heads"))
    kv_heads = _positive_int(config.get("num_key_value_heads")) or heads
    head_dim = _positive_int(config.get("head_dim"))
    hidden = _positive_int(config.get("hidden_size"))
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    if not (layers and kv_heads and head_dim):
        return None
    dtype_bytes = _DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "float16"), 2)
    return KvShape(layers=layers, kv_heads=kv_heads, head_dim=head_dim, bytes_per_element=dtype_bytes)


def context_tokens(config: Mapping[str, Any], context_length: int | None) -> int | None:
    """The context to plan for: the operator's, else the model's own maximum."""
    if context_length:
        return context_length
    nested = config.get("text_config")
    own = config.get("max_position_embeddings")
    if own is None and isinstance(nested, Mapping):
        own = nested.get("max_position_embeddings")
    return _positive_int(own)


def estimate_memory_bytes(
    size_bytes: int | None,
    config: Mapping[str, Any],
    context_length: int | None = None,
    projector_bytes: int | None = None,
) -> int | None:
    """One replica's memory need (see the module docstring); None when the weights' size is unknown."""
    if size_bytes is None:
        return None
    need = math.ceil((size_bytes + (projector_bytes or 0)) * WEIGHTS_FACTOR)
    shape = kv_shape(config)
    tokens = context_tokens(config, context_length)
    if shape is not None and tokens is not None:
        need += shape.bytes_per_token * tokens
    return need


def config_subset(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a ``config.json`` the estimate reads (its ``text_config`` too, for multimodal models)."""
    kept = {key: config[key] for key in CONFIG_KEYS if key in config}
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        kept["text_config"] = {key: nested[key] for key in CONFIG_KEYS if key in nested}
    return kept


def local_file_size(path: str, roots: Sequence[Path]) -> int | None:
    """The size of the file at ``path`` when this machine can read it under ``roots`` (a local projector), or
    None."""
    location = Path(path)
    if not under_roots(location.resolve(), roots):
        return None
    try:
        return location.stat().st_size if location.is_file() else None
    except OSError:
        return None


def read_local_model(path: str, roots: Sequence[Path]) -> LocalModelFiles | None:
    """The weights' size and config of a model folder or file at ``path``, or None when this machine
    cannot read it (the path is meant for the nodes) or it holds no weights.

    Only files under ``roots`` are read (catalog/local_roots.py): a file in the folder that is a link
    out of them is skipped, as is ``path`` itself when it leads out of them.
    """
    location = Path(path)
    if not under_roots(location.resolve(), roots):
        return None
    try:
        if location.is_file():
            return LocalModelFiles(size_bytes=location.stat().st_size, config={})
        if not location.is_dir():
            return None
        weights = [
            item
            for item in location.iterdir()
            if item.suffix in WEIGHT_SUFFIXES and item.is_file() and under_roots(item.resolve(), roots)
        ]
        if not weights:
            return None
        size = sum(item.stat().st_size for item in weights)
        config_file = location / "config.json"
        config = _read_config(config_file) if under_roots(config_file.resolve(), roots) else {}
        return LocalModelFiles(size_bytes=size, config=config)
    except OSError:
        return None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            return {}
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config_subset(values) if isinstance(values, dict) else {}


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value
