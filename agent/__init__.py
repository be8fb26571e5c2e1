"""The node agent (one per machine): registration, GPU inventory, model downloads, engine supervision.

Empty until the control-plane issue; it will share code with the rest only through ``runtime``.
"""
