"""The node agent (one per machine, ``flotilla agent``): registration, inventory, downloads, engine supervision.

It shares code with the rest only through ``runtime``, and starts engines as ``flotilla run`` processes.

* ``node_agent``: the main loop, which builds the parts below and wires them (``run_agent``: as a process);
* ``heartbeats``: the node registered, then its inventory sent every few seconds;
* ``startup_reconcile``: after a restart, the workers left running adopted and reconciled with the control plane;
* ``ownership_checks``: the workers compared with the control plane's list, and those it disowns
  (``ownership``, the verdict) stopped;
* ``task_intake``: the control plane's tasks (start, stop, log tail) taken idempotently, one operation per
  instance at a time; ``instance_start``: a start's steps; ``reported_downloads``: its model's progress;
* ``instance_table``, ``instance_reports``, ``attempt_files``, ``owned_tasks``: what the agent knows of each
  instance, the instances' state reports, each worker's attempt on disk, the agent's background tasks;
* ``control_plane_client``: the control plane's agent API over HTTP, with a report outbox that outlives
  outages of the control plane;
* ``task_consumer``: the node's Celery queue (``node.<name>``), consumed in a thread, handed to the loop;
* ``inventory``: the node's CPUs, memory and GPUs (NVML, or simulated from ``--gpus``), sent in heartbeats;
* ``downloads``: models fetched from the Hugging Face hub into a models folder, or local ones checked;
* ``supervisor``: engine workers started, watched (``readiness``: their etcd registration), stopped, and
  adopted again after the agent restarts (``worker_records``, ``processes``, ``worker_spec``).
"""
