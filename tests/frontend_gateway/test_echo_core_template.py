"""out=echo_core shows the chat template the preprocessor applied, token for token."""

import openai

from tests.servers import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def test_echo_core_returns_the_templated_prompt(echo_core_server: Server) -> None:
    client = openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 👋"}],
    )
    assert reply.choices[0].message.content == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == reply.usage.completion_tokens


def test_echo_core_adds_smollm2s_default_system_prompt(echo_core_server: Server) -> None:
    client = openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content is not None
    assert reply.choices[0].message.content.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    )


def test_echo_core_hides_special_tokens_when_asked(echo_core_server: Server) -> None:
    client = openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)
    reply = client.completions.create(
        model=MODEL, prompt="<|im_start|>plain text", extra_body={"skip_special_tokens": True}
    )
    assert reply.choices[0].text == "plain text"
