"""What the gateway accepts of chat requests' images: the flags' values (openai_api/images.py applies them).

Apart from images.py so that the command line can name its defaults without importing Pillow and httpx.
"""

from dataclasses import dataclass

DEFAULT_MAX_IMAGE_BYTES = 8 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What the gateway accepts of images (``--max-image-bytes``, ``--image-fetch-timeout``,
    ``--image-domains``)."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    #: Host names an image URL may name (a name matches itself and its subdomains); empty: any host.
    domains: tuple[str, ...] = ()
