"""The control plane's own health: its database, its broker, the reconciler's last pass and the agents
seen (``/api/v1/health/``), Prometheus metrics (``/metrics``) and the dashboard's banner when the
reconciler is late."""
