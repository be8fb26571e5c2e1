"""What SGLang is given for one request, and what its stream says back: pure mappings, no SGLang import.

``sampling_params`` is SGLang's ``SamplingParams`` dict (python/sglang/srt/sampling/sampling_params.py); a
request SGLang cannot follow with ``skip_tokenizer_init`` is refused here (RequestRejected, a 400), before it
reaches the engine. ``generate_arguments`` are ``Engine.async_generate``'s other keyword arguments (its ``rid``,
log probabilities). ``token_logprobs`` reads the log probabilities of a stream's chunk.

Guided decoding reaches SGLang's grammar backend (xgrammar by default, ``grammar_backend``) as its sampling
params do: a JSON schema as ``json_schema``, a regex as ``regex``, a grammar as ``ebnf``, and a choice as the
regex whose matches are exactly its strings. SGLang takes one of the three at a time (``SamplingParams.verify``),
as the gateway sends them.
"""

from typing import Any

from engines.shared.grammar_constraints import grammar_constraint
from runtime.errors import RequestRejected
from runtime.protocol import PreprocessedRequest, TokenLogprob


def sampling_params(request: PreprocessedRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for ``request`` (SGLang's SamplingParams names); None options are
    left out, so that SGLang's defaults (the model's generation config) apply.

    Raises RequestRejected for ``min_tokens`` above 0 (unless ``ignore_eos``): SGLang holds EOS back by its
    tokenizer's ``eos_token_id``, which a worker started with ``skip_tokenizer_init`` has none of. SGLang 0.5.x
    refuses it in ``SamplingParams.normalize`` (``raise_if_tokenizer_required``); earlier versions let it
    through to the scheduler's ``BatchedMinNewTokensPenalizer``, which reads ``req.tokenizer`` and takes the
    engine down. With ``ignore_eos`` no EOS ends the answer anyway, so ``min_tokens`` asks nothing more.
    """
    sampling, stop = request.sampling, request.stop_conditions
    min_tokens = 0 if request.prefill_only or stop.ignore_eos else stop.min_tokens
    if min_tokens > 0:
        raise RequestRejected(
            f"min_tokens ({min_tokens}) cannot be honoured by out=sglang: SGLang holds EOS back by its own "
            "tokenizer, which a worker started with skip_tokenizer_init (Flotilla tokenizes) does not load; "
            "leave min_tokens out, or set ignore_eos"
        )
    params: dict[str, Any] = {
        # A prefill worker computes the prompt and the token its pass gives; the decode worker the rest.
        "max_new_tokens": 1 if request.prefill_only else stop.max_tokens,
        "min_new_tokens": 0,
        "ignore_eos": stop.ignore_eos,
        # Stop strings are the gateway's (they need text); SGLang stops on the model's EOS ids and these.
        "stop_token_ids": list(request.eos_token_ids),
    }
    optional = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        # OpenAI-style 0 means "no top-k"; SGLang spells that -1.
        "top_k": (sampling.top_k if sampling.top_k > 0 else -1) if sampling.top_k is not None else None,
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "sampling_seed": sampling.seed,
    }
    params.update({name: value for name, value in optional.items() if value is not None})
    if not request.prefill_only:  # the constraint is the decode worker's to follow
        params.update(grammar_params(request))
    return params


def grammar_params(request: PreprocessedRequest) -> dict[str, str]:
    """SGLang's sampling params that hold ``request``'s answer to its constraint: ``json_schema``, ``regex`` or
    ``ebnf``; empty for a free answer."""
    constraint = grammar_constraint(request)
    if constraint is None:
        return {}
    kind, text = constraint
    return {{"json": "json_schema", "regex": "regex", "grammar": "ebnf"}[kind]: text}


def generate_arguments(request: PreprocessedRequest, rid: str) -> dict[str, Any]:
    """``Engine.async_generate``'s keyword arguments besides the prompt and sampling params: the request's id in
    SGLang (``rid``, what an abort names), and what it reports of log probabilities."""
    arguments: dict[str, Any] = {"rid": rid}
    if request.logprobs is not None and not request.prefill_only:
        # -1: none of the prompt's (GenerateReqInput.normalize's default); the output's, with this many alternatives.
        arguments |= {"return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": request.logprobs}
    return arguments


def token_logprobs(meta_info: dict[str, Any], tokens: int, top: int) -> list[TokenLogprob] | None:
    """The log probabilities of a chunk's last ``tokens`` tokens, from SGLang's ``meta_info``
    (``output_token_logprobs``: ``(logprob, token_id, text)`` per token; ``output_top_logprobs``: a list of such
    per token). Both lists cover the output so far or only the chunk's tokens (incremental streaming): their last
    ``tokens`` entries are this chunk's either way. None when the chunk carries none."""
    sampled = meta_info.get("output_token_logprobs")
    if not tokens or not isinstance(sampled, list) or len(sampled) < tokens:
        return None
    alternatives = meta_info.get("output_top_logprobs")
    tops: list[Any] = alternatives[-tokens:] if isinstance(alternatives, list) and len(alternatives) >= tokens else []
    result = []
    for index, entry in enumerate(sampled[-tokens:]):
        ranked = (tops[index] or []) if tops else []
        likeliest = [(int(other[1]), float(other[0])) for other in ranked[:top]] if top else []
        result.append(TokenLogprob(float(entry[0]), likeliest))
    return result
