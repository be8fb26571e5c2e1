"""LangChain's own OpenAI classes (``langchain-openai``) against a live gateway, with the requests they
send by default: embeddings as token ids, completions as a batch of prompts, and a tool-calling loop that
sends the assistant's calls back with their arguments as JSON text.

The engines are real: llama.cpp embeds (SmolLM2); ``echo_full`` answers a prompt with its text; in the
tool loop ``echo_core`` answers with the prompt the chat template made, so the model "calls a tool"
because the user's message is a call in Hermes's format, and its final answer shows what the template
was given for that call once LangChain sent it back. What the loop proves is the gateway's part: the
call parsed into ``tool_calls``, LangChain's round trip of it accepted, and the template given the
arguments as an object (``| items`` and ``| tojson`` work on it as on Llama 3.1's template); not that a
model chooses tools well.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_openai", reason="langchain-openai is not installed: `make install` (extra frameworks)")

import tiktoken
import tiktoken.model
import tiktoken.registry
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAI, OpenAIEmbeddings

from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from tests.servers import Server, llama_cpp_available, start_server

SMOL = "SmolLM2-135M-Instruct.Q4_1"
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


# --- embeddings: OpenAIEmbeddings' default path sends token ids ----------------------------------------


def smollm2_in_tiktoken(card: ModelCard) -> tiktoken.Encoding:
    """SmolLM2's own tokenizer as a tiktoken encoding: the same byte-level BPE, its ranks the token ids
    (SmolLM2's merges were learnt in id order), its pre-tokenizer's pattern (digits one by one)."""
    data = json.loads(card.tokenizer_json)
    # GPT-2's byte-level alphabet: the printable bytes stand for themselves, the others for 256 + n.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    byte_of = {chr(byte): byte for byte in printable} | {chr(256 + n): byte for n, byte in enumerate(others)}
    special = {token["content"] for token in data["added_tokens"]}
    ranks = {
        bytes(byte_of[char] for char in token): rank
        for token, rank in data["model"]["vocab"].items()
        if token not in special
    }
    pattern = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("smollm2", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


@pytest.fixture
def tiktoken_knows_smollm2(card: ModelCard, monkeypatch: pytest.MonkeyPatch) -> tiktoken.Encoding:
    """tiktoken's encoding for SmolLM2 registered under its model name, where LangChain looks it up.

    OpenAIEmbeddings tokenizes with tiktoken, by the model's name, else with cl100k_base: its ids mean
    nothing to SmolLM2 (and cannot be downloaded here). The model's own vocabulary makes the ids the
    text's, so the vectors can be compared with the text's.
    """
    encoding = smollm2_in_tiktoken(card)
    texts = ["The cat sat on the mat.", "Revenue grew by 4 percent in 2024.\n\nIt's fine."]
    assert [encoding.encode_ordinary(text) for text in texts] == [card.tokenizer.encode(text).ids for text in texts]
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "smollm2", encoding)
    monkeypatch.setitem(tiktoken.model.MODEL_TO_ENCODING, SMOL, "smollm2")
    return encoding


@pytest.mark.llamacpp
@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)")
def test_openai_embeddings_default_token_id_path_embeds_as_the_text_does(
    llamacpp_server: Server, tiktoken_knows_smollm2: tiktoken.Encoding
) -> None:
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by 4 percent.", "A cat was sitting on the rug."]
    by_ids = OpenAIEmbeddings(model=SMOL, base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)
    assert by_ids.check_embedding_ctx_length  # the default: the texts go as token ids
    by_text = OpenAIEmbeddings(
        model=SMOL, base_url=llamacpp_server.api_url, api_key="unused", max_retries=0, check_embedding_ctx_length=False
    )
    vectors = by_ids.embed_documents(texts)
    expected = by_text.embed_documents(texts)
    assert len(vectors) == 3 and len(vectors[0]) == 576
    for got, want in zip(vectors, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert by_ids.embed_query(texts[0]) == pytest.approx(expected[0], abs=1e-5)


# --- completions: OpenAI.batch and generate send the prompts as one list ------------------------------


def test_openai_batch_and_generate_answer_each_prompt(echo_full_server: Server) -> None:
    llm = OpenAI(model="echo", base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    prompts = ["first", "second prompt", "the third"]
    assert llm.batch(prompts) == prompts  # one request with the list; echo_full answers each with itself
    result = llm.generate(prompts)
    assert [[generation.text for generation in generations] for generations in result.generations] == [
        [prompt] for prompt in prompts
    ]
    assert result.llm_output is not None and result.llm_output["token_usage"]["completion_tokens"] == sum(
        map(len, prompts)
    )


def test_chat_openai_default_requests_are_served_whole_and_streamed(echo_full_server: Server) -> None:
    chat = ChatOpenAI(model="echo", base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    assert chat.invoke("Hello there").content == "Hello there"
    assert "".join(str(chunk.content) for chunk in chat.stream("Hi again")) == "Hi again"


# --- a tool-calling loop ------------------------------------------------------------------------------

# A template that shows, after a tool answered, the call as Llama 3.1's template does (``| tojson``) and
# as templates that list arguments do (``| items``); before, the user's message. echo_core answers with it.
LOOP_TEMPLATE = """
{%- set last = messages[-1] -%}
{%- if last.role == 'tool' -%}
{%- set call = messages[-2].tool_calls[0].function -%}
{{ call.name }}({% for key, value in call.arguments | items %}{{ key }}={{ value }}{% endfor %}) -> {{ last.content }}
; arguments: {{ call.arguments | tojson }}
{%- else -%}
{{ last.content }}
{%- endif -%}
"""


@pytest.fixture(scope="module")
def tool_server(card: ModelCard, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """echo_core with SmolLM2's tokenizer, LOOP_TEMPLATE and the hermes tool-call parser."""
    folder = tmp_path_factory.mktemp("loop-model")
    (folder / "tokenizer.json").write_text(card.tokenizer_json)
    (folder / "chat_template.jinja").write_text(LOOP_TEMPLATE)
    args = ["out=echo_core", "--model-config", str(folder), "--tool-call-parser", "hermes", "--context-length", "512"]
    server = start_server(args, folder / "server.log", env={"FLOTILLA_TOKEN_ECHO_DELAY_MS": "0"})
    yield server
    server.stop()


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def test_a_tool_calling_loop_completes_with_the_tool_result(tool_server: Server) -> None:
    llm = ChatOpenAI(model=SMOL, base_url=tool_server.api_url, api_key="unused", max_retries=0)
    agent = llm.bind_tools([get_weather])
    tools: dict[str, Any] = {"get_weather": get_weather}
    messages: list[BaseMessage] = [HumanMessage(HERMES_CALL)]
    for _ in range(3):
        reply = agent.invoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        if not reply.tool_calls:
            break
        messages.extend(tools[call["name"]].invoke(call) for call in reply.tool_calls)
    [first_call] = messages[1].tool_calls  # type: ignore[attr-defined]
    assert (first_call["name"], first_call["args"]) == ("get_weather", {"city": "Paris"})
    assert messages[2].content == "sunny in Paris"
    # Two model steps: the call, then an answer made from the tool's result and the call sent back.
    assert len(messages) == 4
    assert messages[3].content == 'get_weather(city=Paris) -> sunny in Paris\n; arguments: {"city": "Paris"}'
