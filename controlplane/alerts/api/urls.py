from rest_framework.routers import SimpleRouter

from controlplane.alerts.api.views import AlertViewSet, SilenceViewSet

router = SimpleRouter()
router.register("alerts", AlertViewSet, basename="alert")
router.register("silences", SilenceViewSet, basename="silence")
urlpatterns = router.urls
