from rest_framework.routers import SimpleRouter

from controlplane.deployments.api.views import PipelineViewSet

router = SimpleRouter()
router.register("pipelines", PipelineViewSet, basename="pipeline")
urlpatterns = router.urls
