"""Code shared by every Flotilla program: wire types, engine interface, model cards, config, logging.

Nothing in here imports Django or an engine library.
"""
