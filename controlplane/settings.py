"""Django settings, read from the environment (see runtime.config for the typed helpers).

* ``FLOTILLA_DATA_DIR``: the secret key file and the default SQLite database (default
  ``~/.local/share/flotilla``).
* ``FLOTILLA_SECRET_KEY`` / ``FLOTILLA_SECRET_KEY_FILE``: see controlplane/secret_key.py.
* ``DATABASE_URL``: ``postgres://…`` for PostgreSQL; SQLite in the data directory when unset.
* ``FLOTILLA_DEBUG``, ``FLOTILLA_ALLOWED_HOSTS`` (comma-separated); ``FLOTILLA_LOG`` (controlplane/logging_config.py).
* ``FLOTILLA_API_MAX_BODY_BYTES``, ``FLOTILLA_API_BODY_TIMEOUT_S``, ``FLOTILLA_API_THREADS``,
  ``FLOTILLA_API_AGENT_THREADS``, ``FLOTILLA_API_LOG_TAIL_THREADS``: how requests are read and run (below).
* Behind a TLS proxy, cookies, HSTS, login throttling, passwords: see controlplane/web_security.py.
"""

from pathlib import Path

from controlplane.catalog.local_roots import local_model_roots
from controlplane.database import database_config
from controlplane.live.layer import channel_layers
from controlplane.logging_config import logging_settings
from controlplane.secret_key import default_data_dir, load_secret_key
from controlplane.web_security import web_security
from runtime.config import env_bool, env_float, env_int, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("FLOTILLA_DATA_DIR") or default_data_dir())

DEBUG = env_bool("FLOTILLA_DEBUG", False)
# FLOTILLA_LOG, as Flotilla's other processes read it; a failing request's traceback included (logging_config.py).
LOGGING = logging_settings(env_str("FLOTILLA_LOG"))
SECRET_KEY = load_secret_key(DATA_DIR, debug=DEBUG)
ALLOWED_HOSTS = [host.strip() for host in (env_str("FLOTILLA_ALLOWED_HOSTS") or "localhost,127.0.0.1").split(",")]

# Behind the TLS proxy deploy/ recommends: controlplane/web_security.py says what each setting is for.
WEB_SECURITY = web_security()
SECURE_PROXY_SSL_HEADER = WEB_SECURITY.secure_proxy_ssl_header
CSRF_TRUSTED_ORIGINS = WEB_SECURITY.csrf_trusted_origins
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = WEB_SECURITY.secure_cookies
# Says when a refused form is the secure cookies' doing (a plain-HTTP page), and what to do.
CSRF_FAILURE_VIEW = "controlplane.csrf_failure.csrf_failure"
SECURE_HSTS_SECONDS = WEB_SECURITY.hsts_seconds
SECURE_HSTS_INCLUDE_SUBDOMAINS = WEB_SECURITY.hsts_include_subdomains
SECURE_HSTS_PRELOAD = WEB_SECURITY.hsts_preload
AUTH_PASSWORD_VALIDATORS = WEB_SECURITY.password_validators()
LOGIN_MAX_FAILURES = WEB_SECURITY.login_max_failures
LOGIN_WINDOW_S = WEB_SECURITY.login_window_s

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "controlplane.accounts",
    "controlplane.audit",
    "controlplane.catalog",
    "controlplane.fleet",
    "controlplane.deployments",
    "controlplane.planning",
    "controlplane.apikeys",
    "controlplane.batches",
    "controlplane.stored_responses",
    "controlplane.dashboard",
    "controlplane.live",
    "controlplane.health",
    "controlplane.traffic",
    "controlplane.alerts",
]

MIDDLEWARE = [
    # First, so that the request times it records include every other middleware; it answers /metrics.
    "controlplane.health.metrics.MetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the Swagger page's scripts, the admin's, the dashboard's) straight from the packages
    # under uvicorn: no collectstatic step, no second web server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ASGI_APPLICATION = "controlplane.asgi.application"
# The dashboard's live updates (controlplane/live/): Redis at FLOTILLA_REDIS_URL, else the Celery broker's.
CHANNEL_LAYERS = channel_layers()

# The dashboard's own login page (the admin keeps its own).
LOGIN_URL = "dashboard:login"
LOGIN_REDIRECT_URL = "dashboard:overview"
LOGOUT_REDIRECT_URL = "dashboard:login"

DATABASES = {"default": database_config(env_str("DATABASE_URL"), DATA_DIR)}
# Requests run on API_REQUEST_THREADS reused threads (controlplane/request_threads.py), so each thread
# keeps its connection instead of opening one per request; PostgreSQL's are health-checked before reuse.
DATABASES["default"]["CONN_MAX_AGE"] = None

AUTH_USER_MODEL = "accounts.User"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# The folders a local model (folder or GGUF source) must lie under: controlplane/catalog/local_roots.py.
LOCAL_MODEL_ROOTS = local_model_roots(DATA_DIR)

# The API reads request bodies itself (controlplane/api/parsers.py), so it has its own limit.
API_MAX_BODY_BYTES = env_int("FLOTILLA_API_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)
# OpenAI's Batch API (controlplane/batches/): the largest file /v1/files takes and the time its upload may
# take; the gateway a batch's requests are sent to (none: batches are refused, saying so); how many of a
# batch's requests are in flight at once; how long a Celery task works on one batch before handing over;
# how long a runner's hold on a batch lasts unrenewed (it renews it every second): a runner that died is
# followed by another this long after.
FILES_MAX_BYTES = env_int("FLOTILLA_FILES_MAX_BYTES", 200 * 1024 * 1024, minimum=1024)
# All the files one key keeps (its uploads and its batches' outputs): without a bound, one key could fill the disk.
FILES_MAX_BYTES_PER_KEY = env_int("FLOTILLA_FILES_MAX_BYTES_PER_KEY", 10 * 1024**3, minimum=1024)
FILES_UPLOAD_TIMEOUT_S = env_float("FLOTILLA_FILES_UPLOAD_TIMEOUT_S", 600.0, minimum=1.0)
BATCH_GATEWAY_URL = env_str("FLOTILLA_GATEWAY_URL")
BATCH_CONCURRENCY = env_int("FLOTILLA_BATCH_CONCURRENCY", 16, minimum=1)
BATCH_SLICE_S = env_float("FLOTILLA_BATCH_SLICE_S", 30.0, minimum=0.5)
BATCH_LEASE_S = env_float("FLOTILLA_BATCH_LEASE_S", 30.0, minimum=2.0)
# Responses API answers stored for previous_response_id (controlplane/stored_responses/): how long they are
# kept (OpenAI's 30 days), and the largest one the gateway may store (a long conversation is stored whole).
RESPONSES_KEEP_S = env_float("FLOTILLA_RESPONSES_KEEP_S", 30 * 24 * 3600.0, minimum=1.0)
RESPONSES_MAX_BYTES = env_int("FLOTILLA_RESPONSES_MAX_BYTES", 16 * 1024 * 1024, minimum=1024)
# How many requests run Django code at once, in three lanes that cannot starve each other: people's requests,
# agents' reports and log tails (controlplane/request_threads.py). People and agents beyond their threads
# wait in the event loop; log tails beyond theirs get a 503 with Retry-After.
API_REQUEST_THREADS = env_int("FLOTILLA_API_THREADS", 2, minimum=1)
API_AGENT_THREADS = env_int("FLOTILLA_API_AGENT_THREADS", 2, minimum=1)
API_LOG_TAIL_THREADS = env_int("FLOTILLA_API_LOG_TAIL_THREADS", 2, minimum=1)
# Seconds a request's body may take to arrive whole, read before it takes a thread (controlplane/body_limit.py).
API_BODY_TIMEOUT_S = env_float("FLOTILLA_API_BODY_TIMEOUT_S", 10.0, minimum=0.1)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.accounts.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.api.permissions.RolePermission"],
    "DEFAULT_PARSER_CLASSES": ["controlplane.api.parsers.LimitedJSONParser"],
    "DEFAULT_PAGINATION_CLASS": "controlplane.api.pagination.Pagination",
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "controlplane.api.schema.ErrorDocumentingSchema",
    "EXCEPTION_HANDLER": "controlplane.api.exceptions.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Flotilla control plane API",
    "DESCRIPTION": "Models, nodes, pipelines, instances and the audit log of a Flotilla fleet.",
    "VERSION": "1",
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # The Swagger page's scripts come from the drf-spectacular-sidecar package: GPU clusters are often offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # Several records have a "state" with their own choices: name each set after its record.
    "ENUM_NAME_OVERRIDES": {
        "NodeStateEnum": "controlplane.fleet.models.Node.State",
        "InstanceStateEnum": "controlplane.deployments.instance_states.InstanceState",
        "ReportedInstanceStateEnum": "controlplane.deployments.instances.AGENT_REPORTABLE_CHOICES",
        "DownloadStateEnum": "controlplane.fleet.models.Download.State",
        "PipelineStateEnum": "controlplane.deployments.models.Pipeline.State",
        # and two have a "role": a person's, and a worker group's (aggregated, prefill, decode).
        "PersonRoleEnum": "controlplane.accounts.models.Role",
        "WorkerRoleEnum": "controlplane.deployments.models.WorkerGroup.Role",
    },
}

# Email, for the alerts (controlplane/alerts/notify.py): sent to FLOTILLA_ALERT_EMAILS only when
# FLOTILLA_EMAIL_HOST names an SMTP server. The password may come from FLOTILLA_EMAIL_PASSWORD_FILE.
EMAIL_HOST = env_str("FLOTILLA_EMAIL_HOST") or ""
EMAIL_PORT = env_int("FLOTILLA_EMAIL_PORT", 25, minimum=1, maximum=65535)
EMAIL_HOST_USER = env_str("FLOTILLA_EMAIL_USER") or ""
EMAIL_HOST_PASSWORD = env_str("FLOTILLA_EMAIL_PASSWORD") or ""
EMAIL_USE_TLS = env_bool("FLOTILLA_EMAIL_STARTTLS", False)
EMAIL_TIMEOUT = 10
DEFAULT_FROM_EMAIL = env_str("FLOTILLA_EMAIL_FROM") or "flotilla@localhost"
