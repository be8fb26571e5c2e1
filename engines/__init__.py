"""Engines, one module each: a request in, a stream of outputs out (runtime/engine.py)."""
