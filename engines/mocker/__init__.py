"""The mocker engine: a simulated vLLM (scheduler, paged KV cache with prefix caching, timing)."""
