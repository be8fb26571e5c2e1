"""The ``flotilla`` command: the composition root, the one package that imports both the gateway and the engines."""
