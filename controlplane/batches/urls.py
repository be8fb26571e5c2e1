"""OpenAI's file and batch routes, at the control plane's root as the gateway passes them on."""

from django.urls import path

from controlplane.batches import views

urlpatterns = [
    path("v1/files", views.files),
    path("v1/files/<str:file_id>", views.file),
    path("v1/files/<str:file_id>/content", views.file_content),
    path("v1/batches", views.batches),
    path("v1/batches/<str:batch_id>", views.batch),
    path("v1/batches/<str:batch_id>/cancel", views.cancel),
]
