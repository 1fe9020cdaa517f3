"""``twin ui`` in a real headless browser (Debian's chromium driven by Playwright).

The store is filled by the real commands (``real_store``: ``twin eval`` of two policies on the
same Catalog cases, ``twin train`` of the Toy recipe) and served by the real ``twin ui``. Each
page's screenshot is written to ``$TWINRL_UI_SCREENSHOTS`` (docs/ui/ holds the ones docs/ui.md
shows: ``TWINRL_UI_SCREENSHOTS=docs/ui pytest tests/ui/test_browser.py``), else to a temporary
folder.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twin.store import RunStore

from .conftest import SCRIPT, episode

_BROWSER = Path(__file__).resolve().parents[1] / "browser.py"


def _browser_module() -> Any:
    spec = importlib.util.spec_from_file_location("twinrl_tests_browser", _BROWSER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Module scope: Playwright's sync API keeps an event loop running in this thread while it is
# open, and tests elsewhere that call asyncio.run() must not find it.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    helper = _browser_module()
    path = helper.find_chromium()
    if path is None:
        pytest.skip(helper.NO_BROWSER)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("no playwright: pip install 'twinrl[dev]'")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path, args=helper.LAUNCH_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture()
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("TWINRL_UI_SCREENSHOTS")
    folder = Path(where) if where else tmp_path_factory.mktemp("ui-shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _shot(page: Any, folder: Path, name: str) -> None:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path))  # the viewport: small files
    assert path.stat().st_size > 5_000


@pytest.fixture(scope="session")
def real_ui(real_store: dict[str, object]) -> Iterator[str]:
    """`twin ui --port 0` over the real store; its URL (the one it printed)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "twinrl_cli",
            "ui",
            "--store",
            str(real_store["path"]),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"(http://[^ ]+/)", line)
        assert match, f"twin ui printed {line!r}"
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


class _Server:
    """An in-process uvicorn server of ``create_app`` on a free loopback port."""

    def __init__(self, store: Path, poll_s: float = 4.0) -> None:
        import uvicorn

        from twin.ui import create_app

        config = uvicorn.Config(
            create_app(store, poll_s=poll_s), host="127.0.0.1", port=0, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        sock = config.bind_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_twin_ui_listens_on_loopback_by_default(real_ui: str) -> None:
    assert real_ui.startswith("http://127.0.0.1:")


def test_runs_table_and_a_run(page: Any, real_ui: str, real_store: dict, shots: Path) -> None:
    page.goto(real_ui)
    rows = page.locator("table#runs tbody tr")
    assert rows.count() == 3
    assert "heuristic" in rows.nth(1).inner_text() and "train" in rows.nth(0).inner_text()
    _shot(page, shots, "runs")
    page.get_by_role("link", name=str(real_store["heuristic"]), exact=True).click()
    page.wait_for_url(re.compile(rf"/runs/{real_store['heuristic']}$"))
    assert page.locator("#kinds tbody tr").count() >= 2
    assert page.locator("#confusion table").is_visible()
    assert "verdict" in page.locator("#confusion h2").inner_text()
    assert page.locator("#terms tbody tr").count() >= 4
    _shot(page, shots, "run")


def test_a_training_run_shows_its_curves(
    page: Any, real_ui: str, real_store: dict, shots: Path
) -> None:
    page.goto(f"{real_ui}runs/{real_store['train']}")
    captions = page.locator("#curves figure.chart figcaption").all_text_contents()
    names = {c.split()[0] for c in captions if c.strip()}
    assert {
        "rewards/total",
        "losses/loss",
        "losses/kl",
        "losses/clipfrac",
        "perf/tokens_per_s",
    } <= names
    assert page.locator("#curves polyline").count() >= 5  # 3 steps: lines, not dots
    _shot(page, shots, "train")


def test_an_episode_shows_its_tool_calls_and_reward(
    page: Any, real_ui: str, real_store: dict, shots: Path
) -> None:
    page.goto(f"{real_ui}runs/{real_store['heuristic']}")
    page.locator("table.episodes tbody tr").first.get_by_role("link").first.click()
    page.wait_for_url(re.compile(r"/episodes/\d+$"))
    assert page.locator(".call-ok[data-call='search_taxonomy']").count() == 1
    assert page.locator(".call-ok[data-call='submit']").count() == 1
    reward = page.locator("#reward")
    assert "Reward" in reward.locator("h2").inner_text()
    terms = reward.locator("tbody tr").all_inner_texts()
    assert any(t.startswith("policy") for t in terms) and any(
        t.startswith("category") for t in terms
    )
    assert "verdict" in page.locator("#truth").inner_text()
    _shot(page, shots, "episode")


def test_a_comparison_finds_a_flipped_case(
    page: Any, real_ui: str, real_store: dict, shots: Path
) -> None:
    page.goto(real_ui)
    page.locator(f"input.pick[value='{real_store['random']}']").check()
    page.locator(f"input.pick[value='{real_store['heuristic']}']").check()
    page.locator("#compare-selected").click()
    page.wait_for_url(re.compile(r"/compare\?a=\d+&b=\d+$"))
    assert page.url.endswith(f"a={real_store['random']}&b={real_store['heuristic']}")
    fixed = page.locator("#flipped table").first.locator("tbody tr[data-case]")
    assert fixed.count() >= 1  # the heuristic solves a case the random policy does not
    flipped_case = fixed.first.get_attribute("data-case")
    _shot(page, shots, "compare")
    fixed.first.get_by_role("link", name="side by side").click()
    page.wait_for_url(re.compile(r"/compare/case\?"))
    assert flipped_case in page.locator("h1").inner_text()
    assert page.locator(".side ol.transcript").count() == 2
    assert page.locator("#side-b .call-ok[data-call='submit']").count() == 1
    # the random policy's calls fail (every one of its episodes here has invalid calls): marked
    assert page.locator("#side-a .call-invalid").count() >= 1
    assert page.locator("#side-a .call-invalid .call-error").first.inner_text().strip()
    _shot(page, shots, "compare-case")


def test_planted_script_is_shown_as_text_and_never_runs(page: Any, planted_store: dict) -> None:
    server = _Server(planted_store["path"])
    try:
        page.goto(server.url)
        assert page.evaluate("window.__pwned") is None
        assert (
            SCRIPT in page.locator(f"tr[data-run='{planted_store['xss']}'] td.policy").inner_text()
        )
        page.goto(f"{server.url}runs/{planted_store['xss']}")
        page.locator("table.episodes tbody tr a").first.click()
        page.wait_for_url(re.compile(r"/episodes/\d+$"))
        assert page.evaluate("window.__pwned") is None
        text = page.locator("ol.transcript").inner_text()
        assert f"Title: mug {SCRIPT}" in text and f"I think {SCRIPT}" in text
        assert page.locator("ol.transcript script, ol.transcript img").count() == 0
    finally:
        server.stop()


def test_a_running_training_run_updates_live(page: Any, tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    store = RunStore(path)
    run_id = store.start_run("train", "Toy", "tiny")
    store.log_metrics(run_id, 0, {"rewards/total": 0.1, "losses/loss": 1.0})
    server = _Server(path, poll_s=0.3)
    try:
        page.goto(f"{server.url}runs/{run_id}")
        assert "running" in page.locator("#run-status").inner_text()
        assert page.locator("#curves polyline").count() == 0  # one step: dots
        store.log_metrics(run_id, 1, {"rewards/total": 0.4, "losses/loss": 0.7})
        store.add_episodes(run_id, [episode(0, 0.4, twin="Toy")], step=1)
        from playwright.sync_api import expect

        page.locator("#curves polyline").first.wait_for()
        expect(page.locator("#run-episodes")).to_have_text("1")
        store.finish_run(run_id)
        expect(page.locator("#run-status")).to_have_text("finished")
    finally:
        server.stop()
        store.close()
