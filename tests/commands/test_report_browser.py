"""report.html in a real browser: Debian's headless Chromium driven by selenium through the system
chromedriver opens the report of a grid sweep with seed groups and of an Optuna search from
file://, draws every plotly figure, names every job, logs no console error and asks for nothing
but the page itself (no request leaves the machine). scripts/setup_browser.sh installs Chromium;
without it (or selenium, or plotly) the test skips, and fails instead where EXPKIT_REQUIRE_BROWSER
is set (CI). The grid's page, as drawn, is docs/img/sweep-report.png (docs/sweeps.md shows it):
written when missing, or again with EXPKIT_SCREENSHOTS=1."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from conftest import REPO, run_cli, run_module

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOT = REPO / "docs" / "img" / "sweep-report.png"
WIDTH = 1200  # the screenshot's width in CSS pixels (the docs show it at this size)
LOCAL = ("file:", "data:", "blob:", "about:", "chrome:", "devtools:")  # schemes that never leave the machine


def _missing() -> str | None:
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        return f"no {CHROMIUM} and {CHROMEDRIVER} (bash scripts/setup_browser.sh installs them, as root)"
    for module in ("selenium", "plotly"):
        try:
            __import__(module)
        except ImportError:
            return f"no {module} (bash scripts/setup.sh all)"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium (selenium, the system chromedriver), its console and network logged."""
    reason = _missing()
    if reason is not None:
        if os.environ.get("EXPKIT_REQUIRE_BROWSER"):
            pytest.fail(f"{reason} (EXPKIT_REQUIRE_BROWSER is set)")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # (root: Chromium's sandbox refuses to run as root)
        "--disable-dev-shm-usage",  # (a container's small /dev/shm)
        "--disable-background-networking",  # Chromium's own calls home: no request may leave the machine
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        "--no-first-run",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
        f"--window-size={WIDTH},900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _open(driver, page: Path) -> list[str]:
    """Open `page` from file://, wait until plotly has drawn every figure the page holds, and return
    the URLs of every request the page made."""
    from selenium.webdriver.support.ui import WebDriverWait

    figures = page.read_text().count("Plotly.newPlot")
    assert figures >= 3, f"{page} holds {figures} figures"
    driver.get_log("performance"), driver.get_log("browser")  # (emptied: only this page's entries below)
    driver.get(page.as_uri())
    drawn = "return [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.querySelector('.main-svg')).length"
    WebDriverWait(driver, 60).until(lambda d: d.execute_script(drawn) == figures)
    assert driver.execute_script("return document.querySelectorAll('.js-plotly-plot').length") == figures
    requests = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requests.append(message["params"]["request"]["url"])
    requests += driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return requests


def _check(driver, page: Path, jobs: list[str]) -> list[str]:
    """Open `page` and check it (see the module docstring); return its h1 and h2 headings."""
    from selenium.webdriver.common.by import By

    requests = _open(driver, page)
    assert requests and all(url.startswith(LOCAL) for url in requests), requests  # the page, and nothing else
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    names = sorted(a.text for a in driver.find_elements(By.CSS_SELECTOR, "table.jobs a"))
    assert names == sorted(jobs), names
    return [h.text for h in driver.find_elements(By.CSS_SELECTOR, "h1, h2")]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_the_report_of_a_grid_and_of_a_search_draws_every_figure_offline(browser, tmp_path):
    grid, search = "outputs/sweeps/lr_seeds", "outputs/sweeps/search"
    proc = run_cli(
        "-m", "optim.lr=0.1,0.02", "trainer.seed=0,1", "trainer.max_epochs=2", f"hydra.sweep.dir={grid}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.output[-3000:]
    search_args = ["hparams_search=optuna", "trainer.max_epochs=1", "data.batch_size=64", "hydra.sweeper.n_trials=3"]
    proc = run_cli("-m", *search_args, f"hydra.sweep.dir={search}", cwd=tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    headings = {}
    for sweep, jobs in ((grid, ["0", "1", "2", "3"]), (search, ["0", "1", "2"])):
        proc = run_module("expkit.report", sweep, cwd=tmp_path, timeout=180)
        assert proc.returncode == 0, proc.output
        headings[sweep] = _check(browser, tmp_path / sweep / "report.html", jobs)
    assert headings[grid][0] == f"Report: {grid}" and "Seed groups: mean ± std" in headings[grid]
    assert {"Search: optimisation history: val/acc", "Search: importances: val/acc"} <= set(headings[search])

    _open(browser, tmp_path / grid / "report.html")  # the page as a reader first sees it
    shot = tmp_path / "sweep-report.png"
    assert browser.save_screenshot(str(shot))
    width, height = _png_size(shot)
    assert width == WIDTH and height > 300, (width, height)
    if not SCREENSHOT.is_file() or os.environ.get("EXPKIT_SCREENSHOTS"):
        SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
