from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "controlplane.deployments"
    label = "deployments"
    verbose_name = "Deployments: pipelines, their instances and the reconciler"

    def ready(self) -> None:
        # Actions ask for reconciler passes through this one hook; Celery carries them, from a thread of
        # their own (a frozen broker must not hold the request that committed).
        from controlplane import celery_app, reconcile_requests

        reconcile_requests.set_sender(
            reconcile_requests.SendingThread(
                lambda: celery_app.send_reconcile_request(celery_app.app),
                min_interval_s=reconcile_requests.MIN_INTERVAL_S,
            )
        )
