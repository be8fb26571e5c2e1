from rest_framework.routers import SimpleRouter

from controlplane.deployments.api.instances import InstanceViewSet
from controlplane.deployments.api.views import PipelineViewSet

router = SimpleRouter()
router.register("pipelines", PipelineViewSet, basename="pipeline")
router.register("instances", InstanceViewSet, basename="instance")
urlpatterns = router.urls
