"""The catalog's errors that are not the actions' (those are controlplane/errors.py's Invalid, Conflict …)."""


class HubLookupFailed(Exception):
    """The Hugging Face hub could not answer a lookup (catalog/hub_lookup.py); the message says why and what to
    do."""
