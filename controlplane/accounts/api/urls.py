from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.accounts.api.views import MeViewSet, OwnTokenViewSet, PersonViewSet, TokenViewSet

router = SimpleRouter()
router.register("tokens", TokenViewSet, basename="token")
router.register("people", PersonViewSet, basename="person")
router.register("me/tokens", OwnTokenViewSet, basename="own-token")
urlpatterns = [
    path("me/", MeViewSet.as_view({"get": "retrieve"}), name="me"),
    path("me/password/", MeViewSet.as_view({"post": "change_password"}), name="me-password"),
    *router.urls,
]
