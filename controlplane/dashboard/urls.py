from django.contrib.auth import views as auth_views
from django.urls import path

from controlplane.dashboard import views

app_name = "dashboard"
urlpatterns = [
    path("", views.overview_page, name="overview"),
    path("login/", auth_views.LoginView.as_view(template_name="dashboard/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
