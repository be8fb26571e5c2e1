"""The node agent (one per machine): registration, GPU inventory, model downloads, engine supervision.

It shares code with the rest only through ``runtime``, and starts engines as ``flotilla run`` processes.

* ``inventory``: the node's CPUs, memory and GPUs (NVML, or simulated from ``--gpus``), sent in heartbeats;
* ``downloads``: models fetched from the Hugging Face hub into a models folder, or local ones checked;
* ``supervisor``: engine workers started, watched (``readiness``: their etcd registration), restarted,
  stopped, and adopted again after the agent restarts (``worker_records``, ``processes``, ``worker_spec``).
"""
