"""``flotilla up``: the whole stack on one machine, its servers, control plane and workers, restarted when they die."""
