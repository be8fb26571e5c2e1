"""out=llamacpp with a projector (``--mmproj``): SmolLM2 with a tiny random-weight LLaVA-style projector
(tests/engines/tiny_projector.py) takes images through the gateway as llama-server does. The card says vision and
how many tokens an image is; each image is fed where the template put it (two images, two answers; the same image,
the same answer); a slot that held another image's rows is not taken for this one's, while the same image is
reused; the router's block names cover the image; and a projector that does not fit is refused at start."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from launcher.options import RunOptions
from runtime.errors import ModelError
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.image_blocks import request_block_hashes
from tests.engines.image_requests import Recorded, answer, data_uri
from tests.engines.tiny_projector import IMAGE_TOKENS, write_projector
from tests.frontend_gateway.asgi import call
from tests.servers import llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "smollm2-vision"
RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_projector(tmp_path_factory.mktemp("projector") / "mmproj-tiny.gguf")


def options(smollm2: Path, mmproj: Path) -> RunOptions:
    return RunOptions(
        input="http", output="llamacpp", model=str(smollm2), model_name=MODEL, context_length=1024, mmproj=mmproj
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(smollm2: Path, projector: Path) -> AsyncIterator[tuple[GatewayApp, Recorded, TokenModel]]:
    from launcher.run import build_model

    model, engine = build_model(options(smollm2, projector))
    assert isinstance(model, TokenModel)
    await engine.start()
    recorded = Recorded(engine)
    registry = ModelRegistry()
    registry.add(TokenModel(model.card, recorded))  # type: ignore[arg-type]
    yield GatewayApp(registry), recorded, model
    await engine.close()


def chat(*images: str, text: str = "What is in this picture?") -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    content = [{"type": "text", "text": text}, *parts]
    return {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}]}


@pytest.mark.asyncio(loop_scope="module")
async def test_the_card_says_vision_and_how_many_tokens_an_image_is(
    served: tuple[GatewayApp, Recorded, TokenModel],
) -> None:
    _, _, model = served
    card = model.card
    assert card.vision and card.images_in_text and card.image_tokens == IMAGE_TOKENS
    # The placeholder is outside the vocabulary: no text tokenizes to it.
    assert card.image_token_id == card.tokenizer.get_vocab_size(with_added_tokens=True)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_image_is_fed_in_its_place_and_its_tokens_counted(
    served: tuple[GatewayApp, Recorded, TokenModel],
) -> None:
    app, recorded, model = served
    result = await answer(app, chat(data_uri(RED)))
    request = recorded.requests[-1]
    assert request.images is not None and len(request.images) == 1
    image = request.images[0]
    # One placeholder where the user's text ended, the image's bytes as sent, and its size in tokens known.
    assert request.token_ids[image.position] == model.card.image_token_id
    assert request.token_ids.count(model.card.image_token_id) == 1 and image.tokens == IMAGE_TOKENS
    assert result["usage"]["prompt_tokens"] == len(request.token_ids) - 1 + IMAGE_TOKENS
    assert result["choices"][0]["message"]["content"]


@pytest.mark.asyncio(loop_scope="module")
async def test_two_images_are_two_answers_and_a_slot_keeps_only_its_own_image(
    served: tuple[GatewayApp, Recorded, TokenModel],
) -> None:
    app, recorded, _ = served
    red = await answer(app, chat(data_uri(RED)))
    blue = await answer(app, chat(data_uri(BLUE)))
    red_again = await answer(app, chat(data_uri(RED)))
    red_once_more = await answer(app, chat(data_uri(RED)))
    text = [result["choices"][0]["message"]["content"] for result in (red, blue, red_again, red_once_more)]
    assert text[0] != text[1], "the image did not steer the answer"
    assert text[0] == text[2] == text[3]
    red_request = recorded.requests[-1]
    image_at = red_request.images[0].position if red_request.images else -1
    # After blue, the one slot holds blue's rows: only the text before the image is reused, not blue's image.
    assert red_again["usage"]["prompt_tokens_details"]["cached_tokens"] <= image_at
    # After red, red's rows are reused too (all but the last two rows, which are decoded again for logits).
    prompt = red_once_more["usage"]["prompt_tokens"]
    assert red_once_more["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 2


@pytest.mark.asyncio(loop_scope="module")
async def test_the_responses_api_takes_an_input_image_as_chat_takes_an_image_url(
    served: tuple[GatewayApp, Recorded, TokenModel],
) -> None:
    app, recorded, _ = served
    chatted = await answer(app, chat(data_uri(BLUE)))
    content = [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": data_uri(BLUE), "detail": "auto"},
    ]
    body = {
        "model": MODEL,
        "max_output_tokens": 8,
        "temperature": 0,
        "store": False,
        "input": [{"role": "user", "content": content}],
    }
    client = await call(app, "/v1/responses", body)
    assert client.status == 200, client.content
    response = msgspec.json.decode(client.content)
    request = recorded.requests[-1]
    assert request.images is not None and len(request.images) == 1
    # The same prompt and image as the chat request: the same greedy answer, the same widened prompt.
    assert response["output"][-1]["content"][0]["text"] == chatted["choices"][0]["message"]["content"]
    assert response["usage"]["input_tokens"] == chatted["usage"]["prompt_tokens"]


@pytest.mark.asyncio(loop_scope="module")
async def test_two_images_in_one_message_and_a_large_one(served: tuple[GatewayApp, Recorded, TokenModel]) -> None:
    app, recorded, _ = served
    both = await answer(app, chat(data_uri(RED), data_uri(BLUE, size=(600, 400))))
    request = recorded.requests[-1]
    assert request.images is not None and [image.position for image in request.images] == sorted(
        image.position for image in request.images
    )
    assert both["usage"]["prompt_tokens"] == len(request.token_ids) - 2 + 2 * IMAGE_TOKENS


@pytest.mark.asyncio(loop_scope="module")
async def test_the_routers_block_names_cover_the_image(served: tuple[GatewayApp, Recorded, TokenModel]) -> None:
    app, recorded, _ = served
    await answer(app, chat(data_uri(RED)))
    await answer(app, chat(data_uri(BLUE)))
    red, blue = recorded.requests[-2:]
    assert red.token_ids == blue.token_ids and red.images and blue.images
    block = 4
    red_names = request_block_hashes(red.token_ids, red.images, block)
    blue_names = request_block_hashes(blue.token_ids, blue.images, block)
    # Every block of the widened prompt is named (the gateway knows the image's size), the text before the image
    # as text alone, and the blocks from the image's on by the image too.
    assert len(red_names) == (len(red.token_ids) - 1 + IMAGE_TOKENS) // block
    first_image_block = red.images[0].position // block
    assert red_names[:first_image_block] == blue_names[:first_image_block]
    assert red_names[:first_image_block] == sequence_block_hashes(red.token_ids, block)[:first_image_block]
    assert all(r != b for r, b in zip(red_names[first_image_block:], blue_names[first_image_block:], strict=True))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_projector_for_another_width_is_refused_at_start(smollm2: Path, tmp_path: Path) -> None:
    from launcher.run import build_model

    narrow = write_projector(tmp_path / "mmproj-narrow.gguf", text_width=64)
    _, engine = build_model(options(smollm2, narrow))
    with pytest.raises(ModelError, match="could not load the projector"):
        await engine.start()


def test_a_gguf_that_is_not_a_projector_is_refused(smollm2: Path) -> None:
    from launcher.run import build_model

    with pytest.raises(ModelError, match="no vision encoder"):
        build_model(options(smollm2, smollm2))
