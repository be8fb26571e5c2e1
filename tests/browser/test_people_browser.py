"""The People and Account pages in Chromium, against a control plane alone (no fleet: people need none): an
admin adds a person, changes their role, resets their password, and deactivates them while they are logged
in; the person changes their password; the last admin is told why they cannot step down."""

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.agent.control_plane_server import ControlPlaneServer
from tests.browser.chromium import create_person, log_in
from tests.browser.conftest import new_context

ADMIN, PASSWORD = "ada-admin", "browser-tests-password-not-secret"


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneServer]:
    # No broker is reached: changing people sends no task (a closed port, so that nothing else answers).
    server = ControlPlaneServer(tmp_path_factory.mktemp("people-browser"), broker_url="redis://127.0.0.1:9/0")
    server.start()
    create_person(server, ADMIN, "admin", PASSWORD)
    yield server
    server.stop()


def page_of(browser: Browser, control_plane: ControlPlaneServer, username: str, password: str) -> Page:
    context = new_context(browser)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # hx-confirm asks before a deactivation or a reset
    log_in(page, control_plane.url, username, password)
    return page


def note(page: Page) -> str:
    return page.locator("#flash").inner_text()


def test_an_admin_manages_a_person_who_changes_their_password(
    browser: Browser, control_plane: ControlPlaneServer
) -> None:
    admin = page_of(browser, control_plane, ADMIN, PASSWORD)
    admin.get_by_role("link", name="People").click()
    expect(admin).to_have_url(control_plane.url + "/people/")

    admin.get_by_label("Username").fill("bea")
    admin.locator("#id_role").select_option("operator")  # the form's (each row has its own)
    admin.get_by_role("button", name="Add the person").click()
    expect(admin.locator("#created-person")).to_contain_text("bea is added as operator")
    first_password = admin.locator("#new-password").inner_text()

    row = admin.locator(".tr", has_text="bea")
    row.get_by_label("role of bea").select_option("read_only")
    row.get_by_role("button", name="Save").click()
    expect(admin.locator("#flash")).to_contain_text("bea saved.")
    expect(admin.locator(".tr", has_text="bea").get_by_label("role of bea")).to_have_value("read_only")

    admin.locator(".tr", has_text="bea").get_by_role("button", name="Reset password").click()
    expect(admin.locator("#flash")).to_contain_text("bea's new password, shown this once:")
    match = re.search(r"shown this once: (\S+) \(their sessions", note(admin))
    assert match and match.group(1) != first_password

    bea = page_of(browser, control_plane, "bea", match.group(1))
    bea.get_by_role("link", name="bea").click()
    expect(bea).to_have_url(control_plane.url + "/account/")
    bea.locator("#id_old_password").fill(match.group(1))
    bea.locator("#id_new_password").fill("bea's own long passphrase")
    bea.locator("#id_new_password_again").fill("bea's own long passphrase")
    bea.get_by_role("button", name="Change the password").click()
    expect(bea.locator("#flash")).to_contain_text("Your password is changed")

    admin.locator(".tr", has_text="bea").get_by_role("button", name="Deactivate").click()
    expect(admin.locator("#flash")).to_contain_text("bea is deactivated")
    bea.reload()
    expect(bea).to_have_url(re.compile(r"/login/"))  # the session is refused now


def test_the_last_admin_is_told_why_they_cannot_deactivate_themself(
    browser: Browser, control_plane: ControlPlaneServer
) -> None:
    admin = page_of(browser, control_plane, ADMIN, PASSWORD)
    admin.goto(control_plane.url + "/people/")
    admin.locator(".tr", has_text=ADMIN).get_by_role("button", name="Deactivate").click()
    expect(admin.locator("#flash")).to_contain_text("you are the only active admin")
    expect(admin.locator(".tr", has_text=ADMIN)).to_contain_text("active")
