"""The dashboard's login page: Django's, with the throttled form, answering 429 while a user name waits."""

from typing import Any

from django.contrib.auth import views as auth_views
from django.http import HttpResponse

from controlplane.accounts.forms import ThrottledLogin


class LoginView(auth_views.LoginView):
    template_name = "dashboard/login.html"
    authentication_form = ThrottledLogin

    def form_invalid(self, form: Any) -> HttpResponse:
        response = super().form_invalid(form)
        if form.retry_after_s:
            response.status_code = 429
            response["Retry-After"] = str(form.retry_after_s)
        return response
