"""The node agent (one per machine, ``flotilla agent``): registration, inventory, downloads, engine supervision.

It shares code with the rest only through ``runtime``, and starts engines as ``flotilla run`` processes.

* ``node_agent``: the main loop: register and heartbeat, take the control plane's tasks (start, stop, log
  tail), report every instance's state; after a restart, adopt the workers left running and reconcile them;
* ``control_plane_client``: the control plane's agent API over HTTP, with a report outbox that outlives
  outages of the control plane;
* ``task_consumer``: the node's Celery queue (``node.<name>``), consumed in a thread, handed to the loop;
* ``inventory``: the node's CPUs, memory and GPUs (NVML, or simulated from ``--gpus``), sent in heartbeats;
* ``downloads``: models fetched from the Hugging Face hub into a models folder, or local ones checked;
* ``supervisor``: engine workers started, watched (``readiness``: their etcd registration), stopped, and
  adopted again after the agent restarts (``worker_records``, ``processes``, ``worker_spec``).
"""
