from rest_framework.routers import SimpleRouter

from controlplane.fleet.api.views import AgentViewSet, DownloadViewSet, NodeViewSet

router = SimpleRouter()
router.register("nodes", NodeViewSet, basename="node")
router.register("downloads", DownloadViewSet, basename="download")
router.register("agent", AgentViewSet, basename="agent")
urlpatterns = router.urls
