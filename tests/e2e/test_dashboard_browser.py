"""The dashboard in a real headless browser (Debian's chromium driven by Selenium)
against three real node processes: the page shows the login prompt to a missing or
wrong token, shows the two peers of org 1 once the token works (a peer's hostile
display name as text), and its round timeline updates live when a round completes.
Then org 3's node is killed: the page names it as the likely culprit, and so does
``GET /v1/node`` (what ``fedweave status`` prints) at both survivors. A screenshot is
saved under the test's tmp dir."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.e2e.nodes import running_nodes

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ORGS = ("clinic-1", "clinic-2", "clinic-3")
HOSTILE = "<img src=x onerror=alert(1)>"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1800",
)

T = TypeVar("T")

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    pytest.skip(
        "Debian's chromium is not installed (apt-get install -y chromium chromium-driver)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.common.exceptions import (  # noqa: E402
    NoAlertPresentException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
    """Poll ``probe`` until it returns something truthy. The page redraws on every live
    update, so an element found by one call can be replaced before the next: a stale
    element means "look again", not a failure."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            value = probe()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def visible(driver: Any, element_id: str) -> bool:
    return bool(driver.find_element(By.ID, element_id).is_displayed())


def sign_in(driver: Any, token: str) -> None:
    field = driver.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#login-form button[type=submit]").click()


def test_dashboard_shows_peers_and_updates_when_a_round_completes(
    tmp_path: Path, browser: Any
) -> None:
    with running_nodes(tmp_path, ORGS, display_names={ORGS[1]: HOSTILE}) as nodes:
        me = ORGS[0]
        browser.get(nodes.url(me) + "/dashboard")

        # no token: the login prompt and nothing else
        wait_until("the login prompt", lambda: visible(browser, "login"))
        assert not visible(browser, "dashboard")
        assert browser.find_elements(By.CSS_SELECTOR, "#peers-table tbody tr") == []

        # a wrong token: still the prompt, with a message; the token is forgotten
        sign_in(browser, "fw_wrong-token")
        wait_until(
            "the refusal message",
            lambda: "not accepted" in browser.find_element(By.ID, "login-error").text,
        )
        assert visible(browser, "login") and not visible(browser, "dashboard")
        assert browser.execute_script("return sessionStorage.length") == 0

        # the right token: org 1's two peers, by org id, with their live status
        sign_in(browser, nodes.tokens[me])
        wait_until("the dashboard", lambda: visible(browser, "dashboard"))

        def peer_rows() -> dict[str, Any] | None:
            rows = browser.find_elements(By.CSS_SELECTOR, "#peers-table tbody tr")
            found = {r.get_attribute("data-org"): r for r in rows}
            return found if set(found) == set(ORGS[1:]) else None

        wait_until("two peers", peer_rows)
        assert not visible(browser, "login")
        # the hostile display name is text, never markup
        name = wait_until(
            "the second org's name",
            lambda: (peer_rows() or {})[ORGS[1]].find_elements(By.TAG_NAME, "td")[1].text,
        )
        assert name == HOSTILE
        assert browser.find_elements(By.TAG_NAME, "img") == []
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018
        topology = wait_until(
            "the topology",
            lambda: {
                g.get_attribute("data-org")
                for g in browser.find_elements(By.CSS_SELECTOR, "#topology g.peer")
            },
        )
        assert topology == set(ORGS[1:])
        assert me in browser.find_element(By.ID, "topology").text
        wait_until(
            "peers seen alive",
            lambda: (
                {r.get_attribute("data-status") for r in (peer_rows() or {}).values()} == {"alive"}
            ),
        )
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline .round") == []

        # a run: the page follows its event stream and draws each completed round
        spec = {"trainer": "breast_cancer", "rounds": 4, "participants": list(ORGS), "threshold": 2}
        run_ids = nodes.propose_and_accept("dashboard-demo", spec)
        wait_until(
            "the page to follow the accepted run's events",
            lambda: (
                browser.find_element(By.ID, "live-status").get_attribute("data-state") == "live"
            ),
        )
        nodes.start(run_ids)
        wait_until(
            "a live round event",
            lambda: browser.find_elements(By.CSS_SELECTOR, "#events li[data-kind=round]"),
            timeout=45,
        )

        def completed_round() -> tuple[int, set[str | None]] | None:
            done = browser.find_elements(By.CSS_SELECTOR, "#timeline .round[data-state=completed]")
            if not done:
                return None
            bars = len(done[0].find_elements(By.CSS_SELECTOR, "svg.stagebar rect"))
            grid = {
                tr.get_attribute("data-org")
                for tr in done[0].find_elements(By.CSS_SELECTOR, "table.grid tbody tr")
            }
            return bars, grid

        bars, peers_in_grid = wait_until("a completed round in the timeline", completed_round)
        assert bars > 0
        assert peers_in_grid == set(ORGS[1:])
        wait_until(
            "the run's round counter",
            lambda: (
                int(browser.find_element(By.ID, "run-facts").get_attribute("data-round") or 0) >= 1
            ),
        )
        assert browser.find_element(By.ID, "audit-facts").get_attribute("data-ok") == "true"

        # org 3's node dies mid-run: the survivors go on and name it
        dead = ORGS[2]
        os.killpg(nodes.procs[dead].pid, signal.SIGKILL)
        nodes.procs[dead].wait(timeout=10)
        wait_until(
            "the killed node named as the culprit",
            lambda: browser.find_element(By.ID, "culprit").get_attribute("data-org") == dead,
            timeout=45,
        )
        assert visible(browser, "culprit")
        assert browser.find_elements(By.CSS_SELECTOR, "#culprit-evidence li")
        for org in ORGS[:2]:
            with nodes.client(org) as c:

                def named(c: Any = c) -> dict[str, Any] | None:
                    found: dict[str, Any] | None = c.get("/v1/node").json()["culprit"]
                    return found if found is not None and found["org"] == dead else None

                # each survivor scores the dead node from its own rounds: under load a
                # round takes longer, so it gets the page's wait above
                culprit = wait_until(f"{org} naming {dead}", named, timeout=45)
            assert culprit["score"] >= 2.0 and culprit["evidence"], culprit
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
