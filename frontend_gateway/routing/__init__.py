"""Routing: which instance of a model pool takes a request.

protocol.py is the seam (``Router``, ``Decision``, ``RouterSettings``); basic.py holds random and
round-robin; kv_router.py the KV-aware router, with its index (kv_indexer.py), load tracking
(kv_load.py) and pure decision (kv_scoring.py), fed by the KV event subscriber
(kv_subscriber.py); factory.py builds a pool's router from the settings.
"""
