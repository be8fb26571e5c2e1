"""The OpenAI-compatible gateway: HTTP surface, pre/post-processing, and (later) routing."""
