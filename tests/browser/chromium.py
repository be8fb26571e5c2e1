"""Debian's Chromium driven by Playwright, and what the browser tests do in it more than once.

Playwright's own browser download does not work on these machines: the tests launch /usr/bin/chromium
(the `chromium` Debian package, which `make system-deps` installs) with the flags that let it run headless
as root in a VM.
"""

import shutil
from pathlib import Path

from playwright.sync_api import Browser, Page, Playwright, ViewportSize, expect

from tests.agent.control_plane_server import ControlPlaneServer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: A laptop screen; the screenshots in docs/screenshots/ are this size.
VIEWPORT: ViewportSize = {"width": 1366, "height": 768}
#: Milliseconds Playwright's waits allow by default: the fleet's processes answer within seconds.
TIMEOUT_MS = 30_000


def launch(playwright: Playwright) -> Browser:
    """Headless Chromium. Raises AssertionError naming the package when it is not installed."""
    assert CHROMIUM.exists() or shutil.which("chromium"), "no Chromium: install the chromium Debian package"
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)


def create_person(control_plane: ControlPlaneServer, username: str, role: str, password: str) -> None:
    """A person who logs in with ``password`` (``manage.py createtoken`` makes token-only people)."""
    code = (
        "from controlplane.accounts.actions import create_user\n"
        "from controlplane.accounts.models import Role\n"
        "from controlplane.audit.records import Actor\n"
        f"create_user(Actor.system('browser tests'), {username!r}, Role({role!r}), password={password!r})\n"
    )
    control_plane.manage("shell", "--no-imports", "--command", code)


def deactivate_person(control_plane: ControlPlaneServer, username: str) -> None:
    """Deactivate ``username`` as the People page does (``deactivate_user``)."""
    code = (
        "from controlplane.accounts.actions import deactivate_user\n"
        "from controlplane.accounts.models import User\n"
        "from controlplane.audit.records import Actor\n"
        f"deactivate_user(Actor.system('browser tests'), User.objects.get(username={username!r}))\n"
    )
    control_plane.manage("shell", "--no-imports", "--command", code)


def log_in(page: Page, base_url: str, username: str, password: str) -> None:
    """Log in through the login form and land on the overview (asserted)."""
    page.goto(base_url + "/login/")
    page.get_by_label("User name").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(base_url + "/")
    expect(page.locator("header")).to_contain_text(username)
