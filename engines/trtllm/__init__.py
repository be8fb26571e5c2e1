"""The TensorRT-LLM engine: ``tensorrt_llm.LLM`` in the worker process, its KV events and load stats."""
