"""A process's connections to the cluster: etcd discovery, NATS, addresses, the tokenizer object store, and
waiting for those servers at start-up. What travels on them (requests, KV events, tasks) lives elsewhere."""
