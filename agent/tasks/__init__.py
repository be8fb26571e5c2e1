"""The control plane's tasks as the node agent receives them: taken from the broker, checked, handed on."""
