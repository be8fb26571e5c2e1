"""The agent's errors: what went wrong with a download or a worker, said so that a person can act on it.

Each message is what the control plane shows as the instance's reason. ``retryable`` tells the agent's
main loop whether trying again later may help (the network may come back) or only a person can fix it.
Foreign exceptions (huggingface_hub, OSError) are translated into these where they are caught.
"""

from runtime.errors import FlotillaError


class AgentError(FlotillaError):
    """Base class of the agent's own errors."""

    #: Whether the same action may succeed later without anyone changing anything.
    retryable = False


class DownloadError(AgentError):
    """A model could not be downloaded or checked."""


class HubUnreachable(DownloadError):
    """The Hugging Face hub did not answer (no network, DNS, a firewall): retry, or serve from local files."""

    retryable = True


class RepoNotFound(DownloadError):
    """The repo (or its revision, or the file asked for) does not exist, or is private to this token."""


class RepoUnauthorized(DownloadError):
    """The repo is gated or private: HF_TOKEN must name an account that has access."""


class DiskFull(DownloadError):
    """The models folder has no room for the model."""


class LocalModelInvalid(DownloadError):
    """A local model folder or GGUF file is missing or is not a model."""


class WorkerError(AgentError):
    """A worker could not be started, adopted or stopped."""


class TaskNotAllowed(AgentError):
    """A task asks for what this agent does not run: an engine it does not have, a flag it sets itself.

    Only a changed task can succeed: the instance fails with the reason, and is not restarted.
    """
