"""``out=vllm``'s settings: Flotilla's flags plus ``--extra-engine-args``, checked before vLLM starts.

``--extra-engine-args`` is a JSON object of ``AsyncEngineArgs`` fields, by vLLM's own names (those of
``vllm serve``'s flags, with underscores). A key that is not a field of the installed vLLM's dataclass is
refused, naming it, and so is a key that a Flotilla flag owns (the model, the context length, the
tensor-parallel size, the GPU memory share, the nodes it spans): two places to set one thing would disagree.

KV offloading (a host-memory tier below the GPU) is vLLM's own setting too: ``kv_offloading_size`` (GiB of host
memory, with ``kv_offloading_backend`` "native", the default) or a ``kv_transfer_config`` naming the
``OffloadingConnector`` (``kv_connector_extra_config``: ``{"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use":
...}``). Flotilla adds one key to that connector's extra config, ``self_describing_kv_events``: without it vLLM's
events for host copies carry no tokens (a placeholder with block size 0), and a block without its tokens cannot be
given the router's name. vLLM 0.32's CPU build refuses offloading ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"): it runs on a GPU.
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.shared.extra_engine_args import read_engine_args
from engines.shared.node_group import NodeGroup
from engines.vllm.lora import lora_engine_args
from runtime.errors import ConfigError
from runtime.kv.events import Medium

#: The one line a node without the package prints (exit 2).
MISSING_PACKAGE = "out=vllm needs the vllm package: pip install 'flotilla[vllm]'"

#: AsyncEngineArgs fields that Flotilla sets from its own flags, and the flag that sets each.
OWNED_KEYS: dict[str, str] = {
    "model": "MODEL (the positional argument)",
    "tokenizer": "MODEL (Flotilla's preprocessor tokenizes)",
    "served_model_name": "--model-name",
    "max_model_len": "--context-length",
    "tensor_parallel_size": "--tensor-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "skip_tokenizer_init": "nothing: Flotilla gives vLLM token ids",
    "nnodes": "--num-nodes",
    "node_rank": "--node-rank",
    "master_addr": "--leader-addr (HOST of HOST:PORT)",
    "master_port": "--leader-addr (PORT of HOST:PORT)",
}


@dataclass(frozen=True, kw_only=True)
class VllmSettings:
    """What ``out=vllm`` builds its ``AsyncEngineArgs`` from."""

    model: str
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    #: The share of each GPU's memory vLLM may take (weights, activations and KV cache): the control plane's
    #: placement share, so that engines sharing a GPU fit. None: vLLM's default (0.9).
    gpu_memory_utilization: float | None = None
    #: The nodes one instance spans (--num-nodes), and this one's rank.
    nodes: NodeGroup = field(default_factory=NodeGroup)
    #: Extra AsyncEngineArgs fields, checked against the dataclass.
    extra: dict[str, Any] = field(default_factory=dict)
    #: LoRA adapters enabled (``--lora`` / ``--lora-file``; engines/vllm/lora.py), as ``enable_lora`` in ``extra`` does.
    lora: bool = False
    #: How many adapters at once (``--max-loras``, vLLM's ``max_loras``); given, it enables LoRA too.
    max_loras: int | None = None

    @property
    def local_gpus(self) -> int:
        """The GPUs vLLM uses on this node: its tensor x pipeline parallel ranks, split over the nodes.

        Raises ConfigError when they do not split evenly.
        """
        stages = int(self.extra.get("pipeline_parallel_size", 1))
        return self.nodes.local_share(self.tensor_parallel_size * stages)

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``AsyncEngineArgs``."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            # Flotilla tokenizes and detokenizes; vLLM still reads the tokenizer's special ids for EOS.
            "skip_tokenizer_init": False,
            # The numbers behind load(): without them vLLM keeps no scheduler stats.
            "disable_log_stats": False,
            **self.extra,
            **lora_engine_args(self.extra, lora=self.lora, max_loras=self.max_loras),
        }
        if offload_tiers(self.extra) and _offloading_connector(self.extra):
            # Host copies can be named for routers only when their events carry their tokens.
            kwargs["kv_transfer_config"] = with_self_describing_events(kwargs.get("kv_transfer_config"))
        if isinstance(connector := kwargs.get("kv_transfer_config"), dict):
            # JSON gives a dict; AsyncEngineArgs wants vLLM's config object (vllm serve's flag parser converts it).
            from vllm.config import KVTransferConfig

            try:
                kwargs["kv_transfer_config"] = KVTransferConfig(**connector)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"--extra-engine-args: bad kv_transfer_config: {exc}") from exc
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if (leader := self.nodes.leader) is not None and self.nodes.spans_nodes:
            # vLLM's multiprocessing executor over nodes: each node starts its share of the workers, and they
            # form one torch.distributed group at the leader's address.
            kwargs |= {
                "nnodes": self.nodes.num_nodes,
                "node_rank": self.nodes.node_rank,
                "master_addr": leader.host,
                "master_port": leader.port,
            }
        return kwargs


#: vLLM's connectors that keep KV copies in host memory (the native backend of ``kv_offloading_size`` is the first,
#: or the second with VLLM_USE_SIMPLE_KV_OFFLOAD=1).
_HOST_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")


def offload_tiers(extra: dict[str, Any]) -> tuple[Medium, ...]:
    """The tiers below the GPU that vLLM's engine arguments ``extra`` have it keep KV blocks on: ``("cpu",)``
    with ``kv_offloading_size`` (the native backend) or a host-memory offloading connector; () otherwise (no
    offloading, or LMCache, whose store is its own server's)."""
    if extra.get("kv_offloading_size") is not None:
        return ("cpu",) if extra.get("kv_offloading_backend", "native") == "native" else ()
    config = extra.get("kv_transfer_config")
    connector = config.get("kv_connector") if isinstance(config, dict) else getattr(config, "kv_connector", None)
    if connector == "OffloadingConnector":
        spec = _extra_config(config).get("spec_name", "CPUOffloadingSpec")
        return ("cpu",) if spec == "CPUOffloadingSpec" else ()
    return ("cpu",) if connector in _HOST_CONNECTORS else ()


def _offloading_connector(extra: dict[str, Any]) -> bool:
    """Whether vLLM will run its ``OffloadingConnector`` (the one whose events need ``self_describing_kv_events``)."""
    if extra.get("kv_offloading_size") is not None:
        # The native backend is OffloadingConnector (or, with VLLM_USE_SIMPLE_KV_OFFLOAD, one that ignores the key).
        return True
    config = extra.get("kv_transfer_config")
    connector = config.get("kv_connector") if isinstance(config, dict) else getattr(config, "kv_connector", None)
    return bool(connector == "OffloadingConnector")


def _extra_config(config: Any) -> dict[str, Any]:
    found = config.get("kv_connector_extra_config") if isinstance(config, dict) else None
    return found if isinstance(found, dict) else {}


def with_self_describing_events(config: Any) -> Any:
    """``config`` (a kv_transfer_config dict, or None: vLLM builds one for ``kv_offloading_size``) with
    ``self_describing_kv_events`` on, unless it turns it off itself; a config object is returned as it is."""
    if config is not None and not isinstance(config, dict):
        return config
    config = dict(config or {})
    config["kv_connector_extra_config"] = {"self_describing_kv_events": True, **_extra_config(config)}
    return config


def read_extra_args(raw: Path | str | None) -> dict[str, Any]:
    """The JSON object of vLLM engine arguments in file ``raw``, or in ``raw`` itself when a str (as the node
    agent passes it); {} for None. Raises ConfigError naming the source."""
    return read_engine_args(raw, engine="vllm", syntax="json")


def check_extra_args(values: dict[str, Any], known: frozenset[str]) -> None:
    """Refuse a key of ``values`` that is not in ``known`` (AsyncEngineArgs' fields) or that a flag owns.

    Raises ConfigError naming the key.
    """
    for key in values:
        if key in OWNED_KEYS:
            raise ConfigError(f"--extra-engine-args: {key!r} is set by {OWNED_KEYS[key]} for out=vllm; drop it here")
        if key not in known:
            close = sorted(name for name in known if key.replace("-", "_") == name)
            hint = f" (did you mean {close[0]!r}?)" if close else " (see `vllm serve --help`, with underscores)"
            raise ConfigError(
                f"--extra-engine-args: unknown key {key!r} for out=vllm: not an AsyncEngineArgs field{hint}"
            )


def engine_arg_names() -> frozenset[str]:
    """The field names of the installed vLLM's ``AsyncEngineArgs`` (imports vLLM: seconds)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(item.name for item in dataclasses.fields(AsyncEngineArgs))


#: The ``kv_role`` each ``--disagg-role`` needs of vLLM's KV connector.
ROLE_KV_ROLES = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both")}


def check_disagg_role(role: str, extra: dict[str, Any]) -> None:
    """Raise ConfigError unless a prefill or decode worker's ``--extra-engine-args`` give vLLM a KV connector
    (``kv_transfer_config``) whose ``kv_role`` fits: without one, the prompt's KV has nowhere to go."""
    if role not in ROLE_KV_ROLES:
        return
    config = extra.get("kv_transfer_config")
    example = '{"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}'
    if not isinstance(config, dict) or not config.get("kv_connector"):
        raise ConfigError(
            f"--disagg-role {role} with out=vllm needs a KV connector in --extra-engine-args, e.g. {example} "
            "(docs/disaggregation.md)"
        )
    kv_role = config.get("kv_role")
    if kv_role not in ROLE_KV_ROLES[role]:
        raise ConfigError(
            f"--disagg-role {role}: kv_transfer_config's kv_role is {kv_role!r}; a {role} worker's is "
            f"{' or '.join(ROLE_KV_ROLES[role])}"
        )
