"""The KV cache as the fleet sees it: block hashes, engine KV events, and a worker's publisher of both."""
