"""Parsers of model output: reasoning (``<think>…</think>``) and tool calls, chosen per model.

A model's card names its parsers (``flotilla run --reasoning-parser … --tool-call-parser …``, with
vLLM's names); ``chat_output`` combines them for one request. Each parser is fed text as it is
generated, in pieces cut anywhere (a tag may arrive split over several pieces), and holds back only
what could still turn out to be a tag.
"""
