from rest_framework.routers import SimpleRouter

from controlplane.audit.api.views import AuditEntryViewSet

router = SimpleRouter()
router.register("audit", AuditEntryViewSet, basename="audit")
urlpatterns = router.urls
