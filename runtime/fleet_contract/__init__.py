"""What the control plane tells the rest of the fleet and hears back: tasks, reports, signatures, fences,
engine names, router settings, API-key records and served names. The control plane, the node agents,
the workers and the gateway all import these definitions; none of them defines its own."""
