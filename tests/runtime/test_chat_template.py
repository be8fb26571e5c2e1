"""Chat templates render as Hugging Face renders them, and template failures are TemplateErrors."""

import json
from datetime import datetime

import pytest

from runtime.models.card import ModelCard
from runtime.models.chat_template import ChatTemplate, TemplateError

SMOLLM_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# The shape of Qwen 2.5's tool section: a tools list serialized with tojson into the system turn.
TOOLS_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _template(source: str) -> ChatTemplate:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>")


def test_smollm2_template_renders_chatml_for_system_user_and_assistant(smollm2_card: ModelCard) -> None:
    assert smollm2_card.template is not None
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert smollm2_card.template.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_adds_its_default_system_prompt(smollm2_card: ModelCard) -> None:
    assert smollm2_card.template is not None
    prompt = smollm2_card.template.render([{"role": "user", "content": "Hi"}])
    assert prompt == SMOLLM_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_generation_prompt_is_added_only_when_asked(smollm2_card: ModelCard) -> None:
    assert smollm2_card.template is not None
    messages = [{"role": "user", "content": "Hi"}]
    prompt = smollm2_card.template.render(messages, add_generation_prompt=False)
    assert prompt == SMOLLM_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"


def test_raise_exception_becomes_a_template_error_with_the_templates_message() -> None:
    template = _template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}"
    )
    with pytest.raises(TemplateError, match=r"^Conversations must start with a user$"):
        template.render([{"role": "assistant", "content": "hi"}])


def test_a_syntax_error_is_reported_when_the_template_is_compiled() -> None:
    with pytest.raises(TemplateError, match="syntax error at line 1"):
        _template("{% for message in messages %}")


def test_a_message_without_content_is_a_template_error(smollm2_card: ModelCard) -> None:
    assert smollm2_card.template is not None
    with pytest.raises(TemplateError, match="chat template failed"):
        smollm2_card.template.render([{"role": "user"}])


def test_tools_are_rendered_with_hugging_faces_tojson() -> None:
    tool = {
        "type": "function",
        "function": {"name": "weather", "description": "Météo <today> & tomorrow", "parameters": {}},
    }
    prompt = _template(TOOLS_TEMPLATE).render([{"role": "user", "content": "Paris?"}], tools=[tool])
    # Not HTML-escaped and not ASCII-escaped: exactly json.dumps(tool, ensure_ascii=False).
    assert prompt == (
        f"<|im_start|>system\n# Tools\n<tools>\n{json.dumps(tool, ensure_ascii=False)}\n</tools><|im_end|>\n"
        "<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n"
    )


# Llama 3.1's way of showing an earlier call: its arguments as JSON, through tojson; and the items filter.
CALLS_TEMPLATE = (
    "{%- for message in messages if message.tool_calls %}{% set call = message.tool_calls[0].function %}"
    "{{ call.name }} {{ call.arguments | tojson }}{% for key, value in call.arguments | items %} {{ key }}={{ value }}"
    "{% endfor %}{% endfor %}"
)


def _call(arguments: str) -> dict[str, object]:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_an_earlier_calls_arguments_reach_the_template_as_an_object_not_json_text() -> None:
    messages = [{"role": "user", "content": "Paris?"}, _call('{"city": "Paris", "days": 2}')]
    prompt = _template(CALLS_TEMPLATE).render(messages)
    assert prompt == 'get_weather {"city": "Paris", "days": 2} city=Paris days=2'
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'  # not changed


def test_empty_arguments_reach_the_template_as_an_empty_object() -> None:
    assert _template(CALLS_TEMPLATE).render([_call("")]) == "get_weather {}"


def test_tojson_takes_indent_separators_and_sort_keys() -> None:
    template = _template(
        "{{ messages[0] | tojson(indent=2, sort_keys=True) }}|{{ {'a': 1} | tojson(separators=(',', ':')) }}"
    )
    assert template.render([{"role": "user", "content": "x"}]) == ('{\n  "content": "x",\n  "role": "user"\n}|{"a":1}')


def test_no_tools_renders_as_none() -> None:
    assert _template("{{ tools is none }}").render([]) == "True"


def test_bos_eos_and_extra_variables_reach_the_template() -> None:
    template = _template("{{ bos_token }}{{ documents | length }}{{ eos_token }}")
    assert template.render([], documents=[{"text": "a"}, {"text": "b"}]) == "<s>2</s>"


def test_blocks_are_trimmed_like_transformers() -> None:
    template = _template("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert template.render([{"content": "a"}, {"content": "b"}]) == "a\nb\n"


def test_loop_controls_work() -> None:
    template = _template(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    assert template.render([{"content": "a"}, {"content": "b"}]) == "a"


def test_strftime_now_gives_todays_date() -> None:
    assert _template("{{ strftime_now('%Y-%m-%d') }}").render([]) == datetime.now().strftime("%Y-%m-%d")


def test_generation_blocks_render_their_body() -> None:
    template = _template("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert template.render([{"content": "kept"}]) == "kept"


def test_the_sandbox_refuses_to_mutate_the_conversation() -> None:
    with pytest.raises(TemplateError):
        _template("{% set _ = messages.append({'role': 'user'}) %}").render([])


def test_the_sandbox_refuses_unsafe_attributes() -> None:
    with pytest.raises(TemplateError):
        _template("{{ messages.__class__.__mro__ }}").render([])
