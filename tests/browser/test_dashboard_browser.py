"""The dashboard in headless Chromium against a live fleet (mocker workers on simulated GPUs): an operator
adds a model, deploys it, watches it become ready, scales it, sends traffic and stops it, all in the
browser, the pipeline's page updating over its websocket without a reload; meanwhile the traffic shows in
the history charts, the request log and the router's view, and fires an alert that the operator silences.
The flow saves screenshots of the main pages (in docs/screenshots/ with `make screenshots`; the README and
docs/controlplane.md show them).

The tests share one fleet (conftest.py) and run in order; each waits with Playwright's expectations.
"""

import os
import re
import tempfile
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import BrowserContext, Locator, Page, expect

from tests.agent.control_plane_server import wait_for
from tests.browser.chromium import deactivate_person
from tests.browser.conftest import HUB_REPO, READER, LiveFleet
from tests.browser.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Where the screenshots go: a temporary folder, or the README's docs/screenshots/ when
# FLOTILLA_SCREENSHOTS says so (`make screenshots`), so that a test run leaves the tree as it was.
SCREENSHOTS = Path(os.environ.get("FLOTILLA_SCREENSHOTS") or tempfile.mkdtemp(prefix="flotilla-screenshots-"))
MODEL, SERVED = "smollm2-mocker", "smol-chat"
# 10x real time rather than the fleet tests' 1000x: a request then lasts a good part of a second, long
# enough for the workers' once-a-second load reports to catch its KV blocks in use. A small cache makes
# a few requests show as a visible share of it.
MOCKER_ARGS = '{"speedup_ratio": 10, "num_gpu_blocks": 256, "block_size": 16}'
READY_TIMEOUT_MS = 60_000

# Runs in every page before its own scripts. At DOMContentLoaded it keeps the instance states the server
# rendered (the websocket opens after). Then it records, per instance, the KV usage each swapped-in load
# element shows, whenever it differs from the one before.
RECORDER = """
window.__renderedStates = null;
window.__kvUsage = {};
window.__points = {};
document.addEventListener("DOMContentLoaded", () => {
  window.__renderedStates = [...document.querySelectorAll("[id^='instance-'] .state")].map((e) => e.textContent);
});
new MutationObserver((records) => {
  for (const record of records) {
    for (const node of record.addedNodes) {
      if (node.nodeType !== 1) continue;
      const loads = node.matches(".load[data-instance]") ? [node] : node.querySelectorAll(".load[data-instance]");
      for (const load of loads) {
        const { instance, at, kvUsage } = load.dataset;
        if (at === undefined) continue;
        (window.__points[instance] ||= new Set()).add(at);
        if (kvUsage === undefined) continue;
        const seen = (window.__kvUsage[instance] ||= []);
        if (seen[seen.length - 1] !== kvUsage) seen.push(kvUsage);
      }
    }
  }
}).observe(document, { childList: true, subtree: true });
"""
KV_USAGE_MOVED = """
() => Object.values(window.__kvUsage).some((values) => values.length >= 3 && values.some((v) => Number(v) > 0))
"""
# Every instance's charts have this many points (one a second), for a screenshot worth looking at.
CHARTS_FILLED = "(count) => Object.values(window.__points).filter((points) => points.size >= count).length >= 3"
# Every history chart drawn in a section is no wider than its box: none overlaps the next.
CHARTS_FIT = """
(section) => [...section.querySelectorAll("figure.history-chart")].every((figure) => {
  const canvas = figure.querySelector("canvas");
  return !canvas || canvas.getBoundingClientRect().width <= figure.getBoundingClientRect().width + 1;
})
"""
# A name nothing serves: the gateway refuses it (404), and the request log keeps it under that name.
UNSERVED = "no-such-model"


def screenshot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{name}.png")


def instance_states(page: Page, pipeline: int) -> Locator:
    return page.locator(f"#instances-{pipeline} [id^='instance-'] .state")


def test_an_operator_deploys_scales_loads_and_stops_a_model_watching_it_live(
    live_fleet: LiveFleet, operator_page: Page
) -> None:
    page, base, stack = operator_page, live_fleet.url, live_fleet.stack
    page.add_init_script(RECORDER)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()  # logged in by the fixture

    # Add the model: the SmolLM2 GGUF as a local file, served by the mocker.
    page.get_by_role("navigation").get_by_role("link", name="Models").click()
    page.locator("#id_name").fill(MODEL)
    page.locator("#id_source_kind").select_option("gguf")
    page.locator("#id_source").fill(str(stack.smollm2))
    page.locator("#id_engine").select_option("mocker")
    page.get_by_role("button", name="Add the model").click()
    expect(page.locator("#flash")).to_contain_text(f"Model {MODEL} added.")
    expect(page.locator("main").get_by_role("cell", name=MODEL, exact=True)).to_be_visible()
    # The catalog helps choose: a search of the hub, a repo's download size and where it would fit.
    page.locator("#hub input[name='q']").fill("smol")
    page.locator("#hub").get_by_role("button", name="Search").click()
    expect(page.locator("#hub-repos")).to_contain_text(HUB_REPO)
    page.locator("#hub-repos").get_by_role("button", name="Details").first.click()
    expect(page.locator("#hub-details")).to_contain_text("smol-Q4_K_M.gguf")
    expect(page.locator("#hub-add")).to_be_visible()
    screenshot(page, "models")

    # Deploy it with 2 replicas of 1 simulated GPU each; the page it lands on is the pipeline's.
    page.get_by_role("navigation").get_by_role("link", name="Pipelines").click()
    page.locator("#id_name").fill(SERVED)
    page.locator("#id_model").select_option(MODEL)
    page.locator("#id_replicas").fill("2")
    page.locator("#id_gpus_per_replica").fill("1")
    page.locator("#id_engine_args").fill(MOCKER_ARGS)
    page.locator("#id_router_mode").select_option("kv")  # its decisions carry overlaps, for the request log
    page.get_by_role("button", name="Deploy").click()
    expect(page).to_have_url(re.compile(r"/pipelines/\d+/$"))
    pipeline = int(page.url.rstrip("/").rsplit("/", 1)[1])
    # A TTFT target no worker can meet: the traffic below fires the alert (a setting: nothing restarts).
    stack.operator.patch(f"/api/v1/pipelines/{pipeline}/", json={"ttft_target_ms": 1}).raise_for_status()
    page.wait_for_load_state()
    page.evaluate("window.__sameDocument = true")  # gone if the page were reloaded
    expect(page.locator("#live")).to_have_text("live")

    # Both instances become ready on the page, pushed over the websocket.
    rendered = page.evaluate("window.__renderedStates")
    assert len(rendered) == 2 and rendered != ["ready", "ready"], f"already ready when rendered: {rendered}"
    expect(instance_states(page, pipeline)).to_have_text(["ready", "ready"], timeout=READY_TIMEOUT_MS)
    row = page.locator(f"#pipeline-{pipeline}")
    expect(row).to_contain_text("2 / 2")
    # Uptimes tick in the page, without a push or a reload.
    uptime = page.locator(f"#instances-{pipeline} [id^='instance-'] time.age").first
    shown = uptime.text_content()
    expect(uptime).not_to_have_text(shown or "")

    # Scale to 3: the third instance joins the list and becomes ready.
    row.get_by_label("replicas").fill("3")
    row.get_by_role("button", name="Scale").click()
    expect(page.locator("#flash")).to_contain_text(f"{SERVED} scaled to 3.")
    expect(instance_states(page, pipeline)).to_have_text(["ready"] * 3, timeout=READY_TIMEOUT_MS)
    expect(row).to_contain_text("3 / 3")

    # Traffic through the gateway moves the instances' KV usage, in the numbers and the charts.
    assert stack.gateway is not None
    wait_for(f"the gateway to serve {SERVED}", lambda: SERVED in stack.served_models(), explain=live_fleet.logs)
    with Traffic(stack.gateway.api_url, SERVED) as traffic:
        # The overview, in a second tab (this one stays open, unreloaded): its first look at the gateway.
        overview = page.context.new_page()
        overview.goto(base + "/")
        expect(overview.locator("#gateway table")).to_contain_text(SERVED)

        page.wait_for_function(KV_USAGE_MOVED, timeout=45_000)
        expect(page.locator(f"#instances-{pipeline} .chart[data-chart='cache'] canvas").first).to_be_visible()
        page.wait_for_function(CHARTS_FILLED, arg=8)
        # The instances and the first one's charts, in one screen.
        page.get_by_role("heading", name="Instances").evaluate("(heading) => heading.scrollIntoView()")
        screenshot(page, "pipeline")

        # The table reads the gateway again by itself: the rates over the seconds since the first look.
        expect(overview.locator("#gateway")).to_contain_text("since the previous look", timeout=15_000)
        expect(overview.locator(f"#pipeline-{pipeline}")).to_contain_text("3 / 3")
        expect(overview.locator("#fleet-health")).to_contain_text("2 of 2 nodes online")
        expect(overview.locator("#fleet-health")).to_contain_text("3 of 3 instances ready")
        expect(overview.locator("#fleet-kv")).to_contain_text(SERVED)  # pushed by the live bridge
        expect(overview.locator("#fleet-kv [role='row'][data-pipeline] [role='cell']").nth(2)).to_contain_text("%")
        # The fleet's history: the TTFT chart draws once a sample counted requests (its charts read again every 10 s).
        history = overview.locator("section.history[data-scope='fleet'] figure.history-chart")
        expect(history.filter(has_text="TTFT").locator("canvas").first).to_be_visible(timeout=15_000)
        assert overview.locator("section.history[data-scope='fleet']").evaluate(CHARTS_FIT)
        screenshot(overview, "overview")
        overview.goto(base + "/nodes/")
        expect(overview.locator("[id^='node-']")).to_have_count(2)
        expect(overview.locator("section.history[data-scope='node'] canvas").first).to_be_visible()
        assert all(section.evaluate(CHARTS_FIT) for section in overview.locator("section.history").all())
        screenshot(overview, "nodes")
        overview.close()

        # The playground, in another tab: a message sent from the browser to the gateway streams back.
        playground = page.context.new_page()
        playground.goto(base + "/playground/")
        playground.locator("#pg-model").select_option(SERVED)
        playground.locator("#pg-key").fill("sk-flt-any")  # this fleet's gateway asks for no key
        playground.locator("#pg-message").fill("Hello from the playground")
        playground.get_by_role("button", name="Send").click()
        expect(playground.locator("#pg-send")).to_be_enabled()  # the answer has ended
        expect(playground.locator("#pg-error")).to_be_empty()
        expect(playground.locator("#pg-answer")).not_to_be_empty()
        expect(playground.locator("#pg-stats")).to_contain_text("completion tokens")
        playground.close()

        an_alert_fires_and_is_silenced(live_fleet, page.context.new_page())
    assert traffic.answered > 0 and not traffic.failures, (traffic.answered, traffic.failures)
    the_request_log_shows_the_traffic_and_the_routers_decisions(live_fleet, page.context.new_page(), pipeline)

    # Stop the pipeline: its instances stop and leave the page's list.
    row.get_by_role("button", name="Stop").click()
    expect(row.locator(".state")).to_have_text("stopped")
    expect(page.locator(f"#instances-{pipeline}")).to_contain_text("the pipeline is stopped", timeout=READY_TIMEOUT_MS)
    assert page.evaluate("window.__sameDocument") is True, "the pipeline page was reloaded"
    assert {instance["state"] for instance in stack.instances(pipeline)} == {"stopped"}

    page.get_by_role("navigation").get_by_role("link", name="Audit log").click()
    audit = page.locator("#audit-log")
    expect(audit).to_contain_text("pipeline.stop")
    expect(audit).to_contain_text("scaled aggregated 2 → 3")  # each entry's summary of its before and after
    screenshot(page, "audit")
    # An entry opens its before and after, linked to what it is about.
    audit.get_by_role("link", name="pipeline.stop").first.click()
    expect(page.locator("#audit-diff")).to_contain_text("stopped")
    expect(page.locator("#audit-target")).to_have_text(SERVED)


def an_alert_fires_and_is_silenced(live_fleet: LiveFleet, page: Page) -> None:
    """The pipeline's TTFT over its 1 ms target fires an alert: on the open Alerts page (its tables refresh
    themselves) and in the nav's badge; the operator silences it from its row, and the row says so (it still
    fires: a silence holds notifications)."""
    stack = live_fleet.stack

    def firing() -> bool:
        alerts = stack.operator.get("/api/v1/alerts/", params={"firing": "true"}).json()["results"]
        return any(alert["rule"] == "ttft_over_target" and alert["subject_name"] == SERVED for alert in alerts)

    # The page is open before the alert fires (a sample, then a pass: seconds), and its tables take it in by
    # themselves, without a reload.
    page.goto(live_fleet.url + "/alerts/")
    page.evaluate("window.__sameDocument = true")
    wait_for(f"the TTFT alert of {SERVED}", firing, 30, explain=live_fleet.logs)
    row = page.locator("#firing-alerts tr.alert", has_text=SERVED)
    expect(row).to_contain_text("over its target of 1 ms", timeout=15_000)
    assert page.evaluate("window.__sameDocument") is True, "the Alerts page was reloaded"
    expect(page.locator("#alerts-badge")).to_have_text("1", timeout=15_000)  # it refreshes every 10 s
    expect(page.locator("#alerts-badge")).to_have_class(re.compile(r"\bfiring\b"))
    row.get_by_label("Why").fill("the walk's target is 1 ms on purpose")
    row.get_by_role("button", name="Silence").click()
    expect(page.locator("#flash")).to_contain_text("Silenced until")
    expect(row).to_contain_text("silenced until")
    expect(page.locator("#silences")).to_contain_text("the walk's target is 1 ms on purpose")
    screenshot(page, "alerts")
    page.close()


def the_request_log_shows_the_traffic_and_the_routers_decisions(
    live_fleet: LiveFleet, page: Page, pipeline: int
) -> None:
    """The Requests page lists the walk's requests (status 200, a worker) and a refused one; filtering by model
    leaves the refused one out; a row opens the router's decision (the kv router's overlap), whose pipeline page
    shows the router's view."""
    stack = live_fleet.stack
    assert stack.gateway is not None
    refused = httpx.post(
        stack.gateway.api_url + "/chat/completions",
        json={"model": UNSERVED, "messages": [{"role": "user", "content": "Hello"}]},
        timeout=30,
    )
    assert refused.status_code == 404, refused.text
    workers = {instance["name"] for instance in stack.instances(pipeline)}

    page.goto(live_fleet.url + "/requests/")
    rows = page.locator("#requests-table tbody tr")
    # Newest first: the refused request tops the list once the bridge stored it (the page polls every 3 s).
    expect(rows.first).to_contain_text(UNSERVED, timeout=15_000)
    expect(rows.first.locator("td").last).to_contain_text("404")
    served = rows.filter(has_text=SERVED).first
    expect(served.locator("td").last).to_have_text("200")
    expect(served.locator("td").nth(4)).to_contain_text(re.compile("|".join(map(re.escape, workers))))
    expect(served.locator("td").nth(5)).to_have_text(re.compile(r"^\d+ / \d+$"))  # overlap / prompt blocks
    screenshot(page, "requests")

    page.locator("#id_model").fill(SERVED)
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(f"model={SERVED}"))
    expect(rows.filter(has_text=UNSERVED)).to_have_count(0)
    expect(rows.first).to_contain_text(SERVED)

    rows.first.get_by_role("link").click()
    route = page.locator("#route-detail")
    expect(route).to_contain_text("kv")
    expect(route).to_contain_text(re.compile("|".join(map(re.escape, workers))))
    expect(route).to_contain_text(re.compile(r"\d+ of the prompt's \d+ blocks already cached there"))
    screenshot(page, "request")

    page.locator("#request-detail").get_by_role("link", name=f"pipeline {SERVED}").click()
    expect(page.locator("#router-table tbody tr").first).to_contain_text(re.compile(r"\d+ / \d+"))
    page.close()


def test_a_read_only_person_sees_a_pipeline_without_any_control(live_fleet: LiveFleet, reader_page: Page) -> None:
    page, stack = reader_page, live_fleet.stack
    pipeline = stack.deploy("watched", replicas=1, gpus=0)
    stack.wait_ready(pipeline, 1)
    page.goto(f"{live_fleet.url}/pipelines/{pipeline}/")
    expect(instance_states(page, pipeline)).to_have_text(["ready"])
    expect(page.locator("header")).to_contain_text("(read-only)")

    main = page.locator("main")
    # No control at all in the page, hidden or not; the one button left reads: the instance's log tail.
    expect(main.locator("form")).to_have_count(0)
    expect(main.locator("button")).to_have_text(["Log"])
    # The server refuses the controls anyway, CSRF token and all.
    status = page.evaluate(
        """async (url) => {
          const token = JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRFToken"];
          const reply = await fetch(url, {method: "POST", headers: {"X-CSRFToken": token},
                                          body: new URLSearchParams({replicas: "2"})});
          return reply.status;
        }""",
        f"/pipelines/{pipeline}/scale/",
    )
    assert status == 403
    assert stack.pipeline(pipeline)["groups"][0]["replicas"] == 1

    # An operator restarts the only replica: its replacement starts beside it under a new name, the old one
    # stops and leaves the list (no push for it may fail to find its element), and the restart counts.
    (first,) = stack.instances(pipeline)
    stack.operator.post(f"/api/v1/instances/{first['id']}/restart/").raise_for_status()
    replaced = page.locator(f"#instance-{first['id']}")
    expect(replaced).to_have_count(0, timeout=READY_TIMEOUT_MS)
    expect(instance_states(page, pipeline)).to_have_text(["ready"], timeout=READY_TIMEOUT_MS)
    expect(page.locator(f"#instances-{pipeline} [id^='instance-'] [role='cell']").nth(5)).to_have_text("1")

    # The replacement's page: where it went, the restart in its replica's history, its log followed and filtered.
    page.locator(f"#instances-{pipeline} [id^='instance-'] a").first.click()
    expect(page.locator("section.placement")).to_contain_text("Placed on")
    expect(page.locator("section.restarts")).to_contain_text("the replica ran as")
    expect(page.locator("#log-view")).not_to_contain_text("Loading the log")
    page.locator("#log-controls input[name='grep']").fill("no line says this")
    expect(page.locator("#log-view")).to_contain_text("No line of the last 100 contains")
    expect(page.locator("#live")).to_have_text("live")
    page.evaluate("window.scrollTo(0, 0)")  # the log's filter scrolled it down: the placement first
    screenshot(page, "instance")

    # Deactivated meanwhile: the page stops saying "live" and says why.
    deactivate_person(stack.control_plane, READER)
    expect(page.locator("#live")).to_contain_text("deactivated", timeout=20_000)


def test_an_anonymous_visit_is_sent_to_the_login_page(live_fleet: LiveFleet, anonymous: BrowserContext) -> None:
    page = anonymous.new_page()
    for path in ("/", "/pipelines/", "/pipelines/1/", "/audit/"):
        page.goto(live_fleet.url + path)
        expect(page).to_have_url(f"{live_fleet.url}/login/?next={path}")
        expect(page.get_by_role("button", name="Log in")).to_be_visible()


def test_an_invalid_model_shows_the_error_next_to_its_field(live_fleet: LiveFleet, operator_page: Page) -> None:
    page = operator_page
    page.goto(live_fleet.url + "/models/")
    page.locator("#id_name").fill("not-a-path")
    page.locator("#id_source_kind").select_option("gguf")
    page.locator("#id_source").fill("models/smol.gguf")
    page.locator("#id_engine").select_option("mocker")
    with page.expect_response(lambda response: response.request.method == "POST") as posted:
        page.get_by_role("button", name="Add the model").click()
    assert posted.value.status == 400
    expect(page.locator("#id_source_error")).to_contain_text("absolute path on the nodes, not 'models/smol.gguf'")
    expect(page.locator("#id_source")).to_have_value("models/smol.gguf")  # kept, to be corrected
    expect(page.locator("#id_name")).to_have_value("not-a-path")
    expect(page.locator("#id_name_error")).to_have_count(0)
    names = [model["name"] for model in live_fleet.stack.operator.get("/api/v1/models/").json()["results"]]
    assert "not-a-path" not in names
