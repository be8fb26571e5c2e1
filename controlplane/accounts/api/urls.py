from rest_framework.routers import SimpleRouter

from controlplane.accounts.api.views import TokenViewSet

router = SimpleRouter()
router.register("tokens", TokenViewSet, basename="token")
urlpatterns = router.urls
