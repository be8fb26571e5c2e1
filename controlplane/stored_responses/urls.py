"""Stored responses' routes, at the control plane's root as the gateway passes them on."""

from django.urls import path

from controlplane.stored_responses import views

urlpatterns = [
    path("v1/responses/<str:response_id>", views.response),
    path("v1/responses/<str:response_id>/store", views.store),
    path("v1/responses/<str:response_id>/input_items", views.input_items),
    path("v1/responses/<str:response_id>/conversation", views.conversation),
]
