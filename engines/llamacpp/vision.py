"""Images for llama.cpp: a multimodal projector (an "mmproj" GGUF) turns each image into embeddings for the text model.

llama.cpp's mtmd library does the vision part, as llama-server does with ``--mmproj``: it resizes the image as the
projector asks, runs its vision encoder, and gives the rows to feed the text model in the image's place. Some
projectors wrap an image in text tokens of their own (Gemma 3's ``<start_of_image>``); mtmd returns those as text
chunks around the image chunk, and they are fed as the tokens they are. The gateway put one placeholder in the
prompt for each image (the card's ``image_token_id``, outside the vocabulary); the engine widens it to these rows.

Each image row of a prompt is named in the slot's cached tokens by a negative number drawn from the image's
digest (real token ids are never negative): a slot holding another image's rows shares no prefix with this one
(its KV cells hold the other image), while a conversation that repeats an image reuses its cells.

Projectors that place image rows in two dimensions (M-RoPE: Qwen2-VL and its kin) or attend to them both ways
(Gemma 3) need the decoder to do so as well; the engine refuses them at start rather than feed them wrongly.
"""

import ctypes
import importlib
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import EngineError, ModelError
from runtime.protocol import ImageInput

log = logging.getLogger(__name__)

#: Projector types whose every image is the same number of tokens: (image_size / patch_size) ** 2 (LLaVA's).
_FIXED_GRID = frozenset({"mlp", "mlp_norm"})
#: How many images' rows are kept, so that a conversation repeating an image does not encode it again.
_KEPT_IMAGES = 8


def projector_card_fields(path: Path, *, n_vocab: int) -> dict[str, Any]:
    """The card's vision fields for a model served with the projector at ``path``: it takes images, given to the
    template as text (a GGUF's template knows no image parts), with a placeholder outside the vocabulary, and how
    many tokens each image is when the projector's metadata says (LLaVA-style projectors). Raises ModelError
    when the file is not a vision projector."""
    gguf: Any = importlib.import_module("gguf")
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"--mmproj {path} is not a GGUF file llama.cpp can read: {exc}") from exc

    def value(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    if not value("clip.has_vision_encoder"):
        raise ModelError(f"--mmproj {path} has no vision encoder (clip.has_vision_encoder): it cannot read images")
    kind = value("clip.projector_type") or value("clip.vision.projector_type")
    size, patch = value("clip.vision.image_size"), value("clip.vision.patch_size")
    tokens = None
    if kind in _FIXED_GRID and isinstance(size, int) and isinstance(patch, int) and patch > 0:
        tokens = (size // patch) ** 2
    return {"vision": True, "images_in_text": True, "image_token_id": n_vocab, "image_tokens": tokens}


def image_key(digest: str) -> int:
    """The number that stands for each row of an image in a slot's cached tokens: negative, from its digest."""
    return -1 - int(digest[:15], 16)


@dataclass(frozen=True)
class PlacedImage:
    """An image's rows in a widened prompt: ``rows`` (image tokens x the model's width) from position ``first``."""

    first: int
    rows: np.ndarray

    @property
    def end(self) -> int:
        return self.first + len(self.rows)


@dataclass(frozen=True)
class _Encoded:
    """What mtmd makes of one image: text tokens before, the image's rows, text tokens after."""

    before: list[int]
    rows: np.ndarray
    after: list[int]


@dataclass(frozen=True)
class WidenedPrompt:
    """A prompt with each image placeholder widened: ``tokens`` (image rows as their image's key) and where the
    image rows are."""

    tokens: list[int]
    images: list[PlacedImage]


class ImageEncoder:
    """An mtmd context over the text model: images to rows of embeddings. Used on the engine's thread only."""

    def __init__(self, path: Path, model: Any, *, threads: int) -> None:
        try:
            self._mtmd: Any = importlib.import_module("llama_cpp.mtmd_cpp")
        except (ImportError, OSError) as exc:
            raise ModelError(
                "--mmproj needs llama-cpp-python built with its multimodal library (libmtmd); `make install` "
                f"builds it: {exc}"
            ) from exc
        mtmd = self._mtmd
        mtmd.mtmd_log_set(_mtmd_log_callback(), ctypes.c_void_p(0))
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = threads
        params.warmup = False
        self._ctx = mtmd.mtmd_init_from_file(str(path).encode(), model.model, params)
        if not self._ctx:
            raise ModelError(
                f"llama.cpp could not load the projector {path} for this model (its log says why: a projector "
                "made for another model's width, or a file that is not a projector)"
            )
        try:
            if not mtmd.mtmd_support_vision(self._ctx):
                raise ModelError(f"the projector {path} reads no images (an audio projector?)")
            if mtmd.mtmd_decode_use_mrope(self._ctx):
                raise ModelError(
                    f"the projector {path} places image rows in two dimensions (M-RoPE), which this engine's "
                    "decoding does not do yet; serve this model with out=vllm"
                )
        except BaseException:
            self.close()
            raise
        self._width = int(importlib.import_module("llama_cpp").llama_model_n_embd(model.model))
        self._kept: dict[str, _Encoded] = {}

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx:
            self._mtmd.mtmd_free(ctx)

    def image_tokens(self, width: int, height: int) -> int:
        """How many prompt rows a ``width`` x ``height`` image becomes (text tokens around it included); the
        image is prepared, not encoded."""
        encoded = self._run((width, height, bytes(3 * width * height)), encode=False)
        return len(encoded.before) + len(encoded.rows) + len(encoded.after)

    def widen(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> WidenedPrompt:
        """``token_ids`` with the placeholder of each image (at its ``position``) replaced by the image's rows.
        Raises EngineError for an image the engine cannot read."""
        tokens: list[int] = []
        placed: list[PlacedImage] = []
        start = 0
        for image in sorted(images, key=lambda image: image.position):
            if not start <= image.position < len(token_ids):
                raise EngineError(f"an image's placeholder position {image.position} is outside the prompt")
            tokens += token_ids[start : image.position]
            encoded = self._encode(image.data, digest=image.digest)
            tokens += encoded.before
            placed.append(PlacedImage(len(tokens), encoded.rows))
            tokens += [image_key(image.digest)] * len(encoded.rows)
            tokens += encoded.after
            start = image.position + 1
        tokens += token_ids[start:]
        return WidenedPrompt(tokens, placed)

    def _encode(self, data: bytes, *, digest: str | None) -> _Encoded:
        if digest is not None and (kept := self._kept.get(digest)) is not None:
            return kept
        encoded = self._run(_rgb(data), encode=True)
        if digest is not None:
            if len(self._kept) >= _KEPT_IMAGES:
                del self._kept[next(iter(self._kept))]
            self._kept[digest] = encoded
        return encoded

    def _run(self, picture: tuple[int, int, bytes], *, encode: bool) -> _Encoded:
        mtmd = self._mtmd
        width, height, pixels = picture
        buffer = (ctypes.c_uint8 * len(pixels)).from_buffer_copy(pixels)
        bitmap = mtmd.mtmd_bitmap_init(width, height, buffer)
        chunks = mtmd.mtmd_input_chunks_init()
        if not bitmap or not chunks:
            raise EngineError("llama.cpp could not take the image (out of memory?)")
        try:
            part = mtmd.mtmd_input_part(text=None, bitmap=bitmap)
            parts = (ctypes.POINTER(mtmd.mtmd_input_part) * 1)(ctypes.pointer(part))
            status = mtmd.mtmd_tokenize_from_parts(self._ctx, chunks, parts, 1, False)
            if status != 0:
                raise EngineError(f"llama.cpp could not prepare the image (mtmd_tokenize_from_parts: {status})")
            before: list[int] = []
            after: list[int] = []
            rows: np.ndarray | None = None
            for index in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, index)
                kind = mtmd.mtmd_input_chunk_get_type(chunk)
                if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    count = ctypes.c_size_t()
                    ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                    (before if rows is None else after).extend(ids[i] for i in range(count.value))
                elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE and rows is None:
                    rows = self._rows(chunk) if encode else np.empty((mtmd.mtmd_input_chunk_get_n_tokens(chunk), 0))
                else:
                    raise EngineError("the projector made more than one image of one picture, which is not handled")
            if rows is None:
                raise EngineError("the projector made no image rows of the picture")
            return _Encoded(before, rows, after)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def _rows(self, chunk: Any) -> np.ndarray:
        mtmd = self._mtmd
        if mtmd.mtmd_decode_use_non_causal(self._ctx, chunk):
            raise EngineError("the projector's images need two-way attention in the decoder, not done here")
        count = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        status = mtmd.mtmd_encode_chunk(self._ctx, chunk)
        if status != 0:
            raise EngineError(f"llama.cpp could not encode the image (mtmd_encode_chunk: {status})")
        output = mtmd.mtmd_get_output_embd(self._ctx)
        flat = np.ctypeslib.as_array(output, shape=(count * self._width,))
        return flat.reshape(count, self._width).copy()


_LOG_CALLBACK: Any = None  # kept alive while mtmd may call it


def _mtmd_log_callback() -> Any:
    """mtmd's log lines into this module's log: its warnings and errors (it prints every tensor it loads, and each
    image's shape, otherwise)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        llama_cpp: Any = importlib.import_module("llama_cpp")

        def forward(level: int, text: bytes, _: Any) -> None:
            # ggml.h's levels: 3 GGML_LOG_LEVEL_WARN, 4 GGML_LOG_LEVEL_ERROR (llama-cpp-python's _logger.py has
            # them one lower, from an older ggml).
            if level in (3, 4):
                line = text.decode(errors="replace").rstrip()
                log.log(logging.WARNING if level == 3 else logging.ERROR, "mtmd: %s", line)

        _LOG_CALLBACK = llama_cpp.llama_log_callback(forward)
    return _LOG_CALLBACK


def _rgb(data: bytes) -> tuple[int, int, bytes]:
    """The image's width, height and RGB bytes (the gateway already checked that it decodes)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise EngineError(f"the image cannot be decoded: {exc}") from exc
    return rgb.width, rgb.height, rgb.tobytes()
