"""``/v1/tokenize`` and ``/v1/detokenize`` (and vLLM's ``/tokenize``, ``/detokenize``) on a real server: vLLM's
shapes, the count a chat request is charged, round trips, and clear 400s for what cannot be answered."""

import httpx
import openai

from tests.servers import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def test_a_prompt_and_a_chat_are_tokenized_as_their_requests_are_charged(echo_core_server: Server) -> None:
    prompt = httpx.post(f"{echo_core_server.api_url}/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert prompt.status_code == 200, prompt.text
    body = prompt.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) > 1 and body["max_model_len"] == 256 and body["token_strs"] is None

    messages = [{"role": "user", "content": "Hi 👋"}]
    chat = httpx.post(f"{echo_core_server.base_url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    client = openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens

    strs = {"model": MODEL, "prompt": "Hello world", "return_token_strs": True, "add_special_tokens": False}
    with_strs = httpx.post(f"{echo_core_server.api_url}/tokenize", json=strs).json()
    assert "".join(with_strs["token_strs"]).replace("Ġ", " ") == "Hello world"


def test_detokenize_gives_back_the_text_of_tokenized_ids(echo_core_server: Server) -> None:
    text = "<|im_start|>héllo 🌍"
    ids = httpx.post(
        f"{echo_core_server.api_url}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}
    ).json()["tokens"]
    back = httpx.post(f"{echo_core_server.base_url}/detokenize", json={"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": text}  # special tokens kept, as vLLM's


def test_what_cannot_be_answered_is_a_400_naming_the_field(echo_core_server: Server, echo_full_server: Server) -> None:
    url = echo_core_server.api_url

    def error(path: str, body: object, base: str = url) -> tuple[int, str, str | None]:
        answer = httpx.post(f"{base}/{path}", json=body)
        detail = answer.json()["error"]
        return answer.status_code, detail["message"], detail.get("param")

    status, message, param = error("detokenize", {"model": MODEL, "tokens": [1, 10**9]})
    assert (status, param) == (400, "tokens") and "token id 1000000000 is outside the vocabulary" in message
    status, message, _ = error("tokenize", {"model": MODEL, "prompt": "a", "messages": []})
    assert status == 400 and "either prompt" in message
    assert error("tokenize", {"model": MODEL, "prompt": 7})[0] == 400
    assert error("tokenize", {"model": MODEL, "prompt": "a", "guided_json": {}})[0] == 400  # unknown field
    assert error("tokenize", {"model": "nope", "prompt": "a"})[0] == 404
    status, message, param = error("tokenize", {"model": "echo", "prompt": "a"}, echo_full_server.api_url)
    assert (status, param) == (400, "model") and "tokenized by its engine" in message
    assert httpx.get(f"{url}/tokenize").status_code == 405
