"""The mocker's settings: ``--extra-engine-args FILE.json``, with the key names of Dynamo's mocker.

Defaults are vLLM's (and Dynamo's mocker's): 16384 blocks of 64 tokens, 256 sequences and 8192
tokens per step, prefix caching and chunked prefill on, real time (speedup 1), and vLLM v1's
scheduler (``"scheduler": "v1"``; ``"v0"`` keeps vLLM v0's, with its 1% watermark: scheduler.py says
how they differ). No host-memory KV tier unless ``num_host_blocks`` is set (host_tier.py).
"""

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from engines.shared.extra_engine_args import engine_args_source, read_engine_args
from runtime.errors import ConfigError

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class MockerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How the simulated engine behaves; every field is a key of ``--extra-engine-args``."""

    #: KV-cache blocks per dp rank.
    num_gpu_blocks: PositiveInt = 16384
    #: Tokens per KV block (also the block size the card announces to KV routers).
    block_size: PositiveInt = 64
    #: Sequences running at once per dp rank.
    max_num_seqs: PositiveInt = 256
    #: Tokens computed per step per dp rank (prefill chunks plus one per decoding sequence).
    max_num_batched_tokens: PositiveInt = 8192
    enable_prefix_caching: bool = True
    #: Prefill a long prompt over several steps instead of waiting for a step with room for all of it.
    enable_chunked_prefill: bool = True
    #: Whose scheduler and block manager to simulate: vLLM v1's (chunk-by-chunk admission, no watermark,
    #: a copy per block computed) or v0's (whole-prompt admission, a watermark, identical blocks merged).
    scheduler: Literal["v0", "v1"] = "v1"
    #: v0 only: fraction of the blocks a new request may not take (kept for the running ones to grow
    #: into); None: 0.01, v0's default.
    watermark: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] | None = None
    #: Simulated time runs this many times faster than real time; 0: no waiting at all.
    speedup_ratio: NonNegativeFloat = 1.0
    #: An extra speed-up of decode steps only (speculative decoding); 0: decode steps take no time.
    decode_speedup_ratio: NonNegativeFloat = 1.0
    #: Data-parallel ranks in this process, each with its own KV cache and scheduler.
    dp_size: PositiveInt = 1
    #: Seconds ``start()`` waits, as a real engine loads its weights.
    startup_time: NonNegativeFloat | None = None
    #: Which running sequence makes room when blocks run out: the newest (vLLM v1) or the oldest.
    preemption_mode: Literal["lifo", "fifo"] = "lifo"
    #: Disaggregated serving: how fast a prompt's KV moves from a prefill worker to a decode worker, in GB/s
    #: (Dynamo's ``--kv-transfer-bandwidth``; NVLink ~450, InfiniBand ~64). None or 0: it takes no time.
    kv_transfer_bandwidth: NonNegativeFloat | None = None
    #: Bytes of KV cache per token (layers × 2 × KV heads × head size × dtype bytes; SmolLM2-135M in
    #: bf16: 23040): what a disaggregated transfer and a host block copy move. None: the transfer takes no
    #: time (a host tier then needs both its bandwidths at 0).
    kv_bytes_per_token: PositiveInt | None = None
    #: KV blocks of host memory per dp rank (KV offload, Dynamo's ``--num-host-blocks``): prompt blocks are
    #: copied there once computed, and a prompt whose prefix left the device but is on the host is brought
    #: back instead of computed (host_tier.py). None: no host tier. A host block holds ``block_size`` ×
    #: ``kv_bytes_per_token`` bytes.
    num_host_blocks: PositiveInt | None = None
    #: Device-to-host copy bandwidth per dp rank in decimal GB/s (``--host-offload-d2h-bandwidth-gbps``).
    #: None: 32, Dynamo's default; 0: copies take no time.
    host_offload_d2h_bandwidth_gbps: NonNegativeFloat | None = None
    #: Host-to-device copy bandwidth per dp rank in decimal GB/s (``--host-offload-h2d-bandwidth-gbps``).
    #: None: 32, Dynamo's default; 0: copies take no time.
    host_offload_h2d_bandwidth_gbps: NonNegativeFloat | None = None
    #: LoRA adapters it holds at once (vLLM's ``max_loras``): a load past it is refused.
    max_loras: PositiveInt = 4
    #: Seconds loading an adapter takes (real time, as a real engine reads the adapter's weights).
    lora_load_time: NonNegativeFloat = 0.05


KNOWN_KEYS: tuple[str, ...] = MockerConfig.__struct_fields__
SCHEDULERS = ("v1", "v0")
#: Host copy bandwidth in GB/s when none is given: Dynamo 1.6.1's mocker's (its ``NativeHostOffloadConfig``).
DEFAULT_HOST_BANDWIDTH_GBPS = 32.0
_HOST_BANDWIDTH_KEYS = ("host_offload_d2h_bandwidth_gbps", "host_offload_h2d_bandwidth_gbps")


def parse_mocker_config(values: Any, source: str = "--extra-engine-args") -> MockerConfig:
    """``values`` (a decoded JSON object) as a MockerConfig.

    Raises ConfigError naming ``source`` and the offending key, and listing the known keys.
    """
    known = ", ".join(KNOWN_KEYS)
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a JSON object of mocker settings (keys: {known})")
    for key in values:
        if key not in KNOWN_KEYS:
            raise ConfigError(f"{source}: unknown key {key!r}; known keys: {known}")
    scheduler = values.get("scheduler", "v1")
    if scheduler not in SCHEDULERS:
        raise ConfigError(
            f'{source}: "scheduler" must be "v1" (vLLM v1\'s scheduler, the default) or "v0" (vLLM v0\'s), '
            f"not {scheduler!r}"
        )
    if scheduler == "v1" and values.get("watermark") is not None:
        raise ConfigError(
            f'{source}: "watermark" is a setting of vLLM v0\'s scheduler; v1 has none: drop it, or add '
            '"scheduler": "v0"'
        )
    try:
        config = msgspec.convert(values, MockerConfig)
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `int` >= 1, got `0` - at `$.num_gpu_blocks`": name the key up front.
        message, _, where = str(exc).rpartition(" - at `$.")
        key = where.rstrip("`").split("[")[0].split(".")[0]
        if not message:
            raise ConfigError(f"{source}: {exc}; known keys: {known}") from None
        raise ConfigError(f"{source}: bad value for key {key!r}: {message}; known keys: {known}") from None
    if config.max_num_batched_tokens < config.max_num_seqs:
        # As vLLM refuses it: a step must have room for a token of every running sequence.
        raise ConfigError(
            f"{source}: max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({config.max_num_seqs})"
        )
    _check_host_tier(config, source)
    return config


def host_bandwidths(config: MockerConfig) -> tuple[float, float]:
    """(device-to-host, host-to-device) copy bandwidth in GB/s, the default for one not given (0: no time)."""
    d2h, h2d = config.host_offload_d2h_bandwidth_gbps, config.host_offload_h2d_bandwidth_gbps
    return (
        DEFAULT_HOST_BANDWIDTH_GBPS if d2h is None else d2h,
        DEFAULT_HOST_BANDWIDTH_GBPS if h2d is None else h2d,
    )


def _check_host_tier(config: MockerConfig, source: str) -> None:
    """Refuse host-tier settings that cannot work together, as Dynamo's mocker refuses them, saying what to add."""
    if config.num_host_blocks is None:
        given = [key for key in _HOST_BANDWIDTH_KEYS if getattr(config, key) is not None]
        if given:
            # Dynamo: "--host-offload-* flags require --num-host-blocks".
            raise ConfigError(
                f"{source}: {' and '.join(repr(key) for key in given)} set the host tier's copy speed, but there "
                'is no host tier: add "num_host_blocks" (KV blocks of host memory per dp rank), or drop them'
            )
        return
    if config.scheduler != "v1":
        raise ConfigError(
            f'{source}: "num_host_blocks" (the host KV tier) is simulated with vLLM v1\'s scheduler only: drop '
            '"scheduler": "v0", or drop "num_host_blocks"'
        )
    if not config.enable_prefix_caching:
        # Blocks are found on the host by their names: without prefix caching nothing would ever come back.
        raise ConfigError(
            f'{source}: "num_host_blocks" needs prefix caching: drop "enable_prefix_caching": false, or drop '
            '"num_host_blocks"'
        )
    if config.kv_bytes_per_token is None and any(bandwidth > 0 for bandwidth in host_bandwidths(config)):
        # A copy's time is its bytes over the bandwidth; with both bandwidths 0 (no time) sizes do not matter.
        raise ConfigError(
            f'{source}: "num_host_blocks" needs "kv_bytes_per_token" (bytes of KV per token) to size a host '
            "block (block_size x kv_bytes_per_token bytes) and time its copies: add it, or set both "
            '"host_offload_d2h_bandwidth_gbps" and "host_offload_h2d_bandwidth_gbps" to 0 (copies take no time)'
        )


def load_mocker_config(path: Path | str | None) -> MockerConfig:
    """The settings in JSON file ``path``, or in ``path`` itself when it is a str holding a JSON object (as
    the node agent passes a pipeline's settings); the defaults when None. Raises ConfigError (see
    parse_mocker_config)."""
    if path is None:
        return MockerConfig()
    return parse_mocker_config(read_engine_args(path, engine="mocker", syntax="json"), engine_args_source(path))
