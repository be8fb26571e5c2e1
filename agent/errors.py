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
    """A model could not be downloaded or checked.

    Retryable unless a subclass says otherwise: a hub that rate-limits (429) or has an incident, a gated
    repo whose access is pending, a disk that someone is freeing, an error nobody foresaw. The control
    plane backs off and tries again, up to its restart limit; giving up at once would turn a hub's bad
    minute during a scale-up into every replica given up.
    """

    retryable = True


class SourceRefused(DownloadError):
    """The source itself cannot be fetched as written (a malformed repo id, a local path that is not a
    model): only a changed source can succeed."""

    retryable = False


class HubUnreachable(DownloadError):
    """The Hugging Face hub did not answer (no network, DNS, a firewall): retry, or serve from local files."""


class RepoNotFound(DownloadError):
    """The repo (or its revision, or the file asked for) does not exist, or is private to this token."""


class RepoUnauthorized(DownloadError):
    """The repo is gated or private: HF_TOKEN must name an account that has access."""


class DiskFull(DownloadError):
    """The models folder has no room for the model."""


class LocalModelMissing(DownloadError):
    """A local model path does not exist (yet): a file system not mounted, a copy not finished."""


class LocalModelInvalid(SourceRefused):
    """A local model folder or GGUF file is not a model."""


class WorkerError(AgentError):
    """A worker could not be started, adopted or stopped."""


class TaskNotAllowed(AgentError):
    """A task asks for what this agent does not run: an engine it does not have, a flag it sets itself.

    Only a changed task can succeed: the instance fails with the reason, and is not restarted.
    """
