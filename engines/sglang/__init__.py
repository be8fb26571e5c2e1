"""The SGLang engine: ``sglang.Engine`` in the worker process, and followers on other nodes."""
