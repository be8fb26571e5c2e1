from django.urls import path

from controlplane.health.api.views import HealthView

urlpatterns = [path("health/", HealthView.as_view(), name="health")]
