"""Process titles, so that ``ps`` names each program of the stack rather than ``python -m launcher.cli …``:
``flotilla up``, ``flotilla agent NODE``, ``flotilla gateway``, ``flotilla worker NAMESPACE.COMPONENT.ENDPOINT
ENGINE``, ``flotilla run in=… out=…``."""

import setproctitle

from launcher.options import RunOptions
from runtime.cluster.addressing import EndpointAddress


def set_title(title: str) -> None:
    """Show ``title`` as this process's command line (``ps -o args``, ``/proc/PID/cmdline``) and, cut to 15
    bytes, as its name (``ps -o comm``, ``top``)."""
    setproctitle.setproctitle(title)


def run_title(options: RunOptions) -> str:
    """The title of ``flotilla run`` with ``options``. Raises ConfigError for a malformed in=dyn:// address."""
    if options.node_rank > 0:  # it serves nothing, whatever in= says (launcher/follower.py)
        return f"flotilla run out={options.output} rank {options.node_rank} of {options.num_nodes}"
    if options.output == "dyn" and options.input == "http":
        return "flotilla gateway"
    if (address := options.worker_address) is not None:
        parsed = EndpointAddress.parse(address)
        return f"flotilla worker {parsed.namespace}.{parsed.component}.{parsed.endpoint} {options.output}"
    return f"flotilla run in={options.input} out={options.output}"
