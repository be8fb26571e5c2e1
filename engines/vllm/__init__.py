"""The vLLM engine: vLLM's async engine in the worker process, its settings, and followers on other nodes."""
