"""Code shared by every Flotilla program; nothing in here imports Django or an engine library.

At the top, the kernel every process uses (errors, config, settings, logging, supervision), the engine
interface (engine.py, protocol.py) and the worker API (distributed.py, endpoint.py). Below them, by topic:
cluster/ (etcd and NATS connections), request_plane/ (requests over NATS), kv/ (KV events), models/ (model
files) and fleet_contract/ (what the control plane says to the fleet and hears back).
"""
