"""The Flotilla control plane: a Django project whose apps keep the fleet's desired state.

* ``accounts``: people with a role, and API tokens for people and node agents.
* ``audit``: the log every action writes (who, what, when, before/after).
* ``catalog``: models and where their files come from.
* ``fleet``: nodes and GPUs as agents report them, instances and their state machine, downloads.
* ``deployments``: pipelines, their worker groups, and ``placement.place`` (a pure function).
* ``api``: what the apps' REST APIs share (/api/v1/: auth, roles, errors, pagination, schema).

State changes only in each app's ``actions.py``. It never imports engine libraries.
"""
