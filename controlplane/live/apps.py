from django.apps import AppConfig


class LiveConfig(AppConfig):
    """The dashboard's live updates: change notices out of this process, websocket consumers, the NATS bridge."""

    name = "controlplane.live"
    label = "live"

    def ready(self) -> None:
        from controlplane.live import events
        from controlplane.live.publisher import Publisher

        # One per process (its thread starts on the first change): the actions' notices leave through it.
        self.publisher = Publisher()
        events.connect(self.publisher)
