"""Who may call the gateway and how much: API keys and per-key quotas."""
