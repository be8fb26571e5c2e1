"""Engines (one module each) and the ``flotilla run`` composition of inputs and outputs."""
