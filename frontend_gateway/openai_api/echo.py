"""``echo`` on completions, as vLLM serves it: the prompt comes back before the answer, with its tokens' log
probabilities when ``logprobs`` is asked too.

Evaluation harnesses score text this way (lm-evaluation-harness's ``local-completions``: ``echo: true``,
``max_tokens: 0`` or 1, ``logprobs: 1``, the prompt being context + continuation): they read the log
probabilities of the prompt's tokens. The first prompt token has none (nothing comes before it), so its
entry is null, as in OpenAI's and vLLM's answers. ``max_tokens: 0`` (only with echo) shows the prompt alone:
as vLLM, the engine still computes one token, which is neither shown nor left out of ``completion_tokens``.
"""

from dataclasses import dataclass

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.openai_api.types import CompletionRequest, SamplingFields

__all__ = ["Echo", "echo_plan"]


@dataclass(frozen=True, slots=True)
class Echo:
    """What a request's echo asks: the prompt's log probabilities (and this many alternatives at each
    token; None: no log probabilities), and whether the generated text is hidden (``max_tokens: 0``)."""

    prompt_logprobs: int | None
    hidden: bool


def echo_plan(
    request: SamplingFields, logprobs: int | None, *, model: str, engine: str | None, prompt_logprobs: bool
) -> Echo | None:
    """The echo ``request`` asks for (None: none), ``logprobs`` being its checked ``logprob_count``;
    ``prompt_logprobs``: whether the model's engine reports the prompt's (its card says), ``engine`` its name.

    Raises InvalidRequest, naming ``logprobs``, when echo asks the prompt's log probabilities of an engine that
    cannot compute them: the answer would lack them, or hold numbers that are not the model's.
    """
    if not isinstance(request, CompletionRequest) or not request.echo:
        return None
    if logprobs is not None and not prompt_logprobs:
        served_by = f"out={engine}" if engine else "its engine"
        raise InvalidRequest(
            f"echo with logprobs asks for the log probabilities of the prompt's tokens, and model {model!r} is "
            f"served by an engine that does not compute them ({served_by}; out=llamacpp and out=vllm do); "
            "leave logprobs out to have the prompt echoed alone",
            param="logprobs",
        )
    return Echo(prompt_logprobs=logprobs, hidden=request.max_tokens == 0)
