"""Building a model pool's router from the settings (the ``--router-*`` flags) and the pool's card."""

from nats.aio.client import Client as NATS

from frontend_gateway.routing.basic import RandomRouter, RoundRobinRouter
from frontend_gateway.routing.health import RoutingHealth
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.protocol import Router, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress


def build_router(
    settings: RouterSettings,
    *,
    block_size: int,
    nc: NATS,
    address: EndpointAddress | None,
    health: RoutingHealth | None = None,
    lora_id: int | None = None,
) -> Router:
    """A new, not yet started router for one pool whose instances serve ``address``.

    ``block_size`` is the card's ``kv_cache_block_size``; ``health`` hears the KV router's repairs and
    decisions (the basic routers have none to tell); ``lora_id`` makes a LoRA adapter's pool's KV router
    (runtime/lora.py). Raises ValueError in KV mode for a block size below 1
    or an unknown address (the KV router listens on its component's subjects).
    """
    if settings.mode is RouterMode.RANDOM:
        return RandomRouter(seed=settings.seed)
    if settings.mode is RouterMode.ROUND_ROBIN:
        return RoundRobinRouter()
    if address is None:
        raise ValueError("the KV router needs the endpoint the instances serve, to hear their KV events")
    return KvRouter(settings, block_size=block_size, nc=nc, address=address, health=health, lora_id=lora_id)
