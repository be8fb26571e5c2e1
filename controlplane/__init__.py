"""The Flotilla control plane: a Django project (dashboard, REST API, reconciler).

Only the project shell exists so far; the apps (catalog, fleet, deployments, api, dashboard) arrive
with the control-plane issue. It never imports engine libraries.
"""
