from rest_framework.routers import SimpleRouter

from controlplane.apikeys.api.usage import UsageViewSet
from controlplane.apikeys.api.views import ApiKeyViewSet

router = SimpleRouter()
router.register("api-keys", ApiKeyViewSet, basename="api-key")
router.register("usage", UsageViewSet, basename="usage")
urlpatterns = router.urls
