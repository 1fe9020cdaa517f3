"""``twin ui`` pages over a planted store, through Starlette's test client (no browser)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from twin.errors import ConfigError
from twin.store import RunStore, RunTable
from twin.ui import check_host, create_app, is_loopback
from twin.ui.charts import line_chart

from .conftest import episode


@pytest.fixture()
def client(planted_store: dict[str, object]) -> TestClient:
    return TestClient(create_app(planted_store["path"]), base_url="http://127.0.0.1")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_runs_table_lists_each_run_with_its_figures(client: TestClient, planted_store) -> None:
    page = client.get("/")
    assert page.status_code == 200
    rows = re.findall(r'<tr data-run="(\d+)">', page.text)
    assert rows == [str(planted_store[k]) for k in ("xss", "train", "b", "a")]  # newest first
    a_row = page.text.split(f'<tr data-run="{planted_store["a"]}">')[1].split("</tr>")[0]
    # heuristic: rewards 1, -1, 1, 0.2 -> mean 0.3, sample sd 0.945, 95% interval 0.3 -+ 0.926;
    # pass@1 from the run's summary
    assert "heuristic" in a_row and "0.300" in a_row and "[-0.626, 1.226]" in a_row
    assert "@1</span> 0.500" in a_row
    assert "test" in a_row and "finished" in a_row


def test_runs_table_filters_and_sorts(client: TestClient, planted_store) -> None:
    trains = re.findall(r'<tr data-run="(\d+)">', client.get("/?kind=train").text)
    assert trains == [str(planted_store["train"])]
    tuned = re.findall(r'<tr data-run="(\d+)">', client.get("/?q=TUNED").text)
    assert tuned == [str(planted_store["b"])]
    by_reward = re.findall(r'<tr data-run="(\d+)">', client.get("/?sort=reward&desc=1").text)
    assert by_reward[0] == str(planted_store["b"])  # mean 0.625, the highest
    assert client.get("/?status=failed").text.count("<tr data-run=") == 0
    bad = client.get("/?sort=nope")
    assert bad.status_code == 400 and "sort must be one of" in bad.text


def test_a_runs_summary_and_its_episodes_give_the_same_figures(planted_store) -> None:
    from twin.ui.queries import _rows, kind_table, run_row, term_means
    from twin.ui.store import open_readonly

    engine, _ = open_readonly(planted_store["path"])
    finished = run_row(engine, planted_store["a"])  # figures from its summary
    assert finished is not None and finished.metrics["reward_mean"] == pytest.approx(0.3)
    counted = replace(finished, status="running", metrics={})  # figures from its episodes
    with Session(engine) as session:
        run = session.get(RunTable, planted_store["a"])
        session.expunge(run)
        run.status = "running"  # a copy only: the store is read-only
        by_episodes = _rows(session, [run], None)[0]
    assert (by_episodes.reward_mean, by_episodes.reward_lo, by_episodes.reward_hi) == pytest.approx(
        (finished.reward_mean, finished.reward_lo, finished.reward_hi)
    )
    by_summary = {k["kind"]: k for k in kind_table(engine, finished)}
    by_db = {k["kind"]: k for k in kind_table(engine, counted)}
    assert by_summary.keys() == by_db.keys() == {"ok_listing", "counterfeit"}
    for kind in by_db:
        assert by_db[kind]["episodes"] == by_summary[kind]["episodes"]
        assert by_db[kind]["reward_mean"] == pytest.approx(by_summary[kind]["reward_mean"])
    assert (
        by_summary["counterfeit"]["success_rate"] == 0.5
        and by_db["counterfeit"]["success_rate"] is None
    )
    assert dict(term_means(engine, counted)) == pytest.approx(dict(term_means(engine, finished)))
    engine.dispose()


def test_a_run_without_summary_is_counted_in_one_pass(planted_store) -> None:
    from twin.ui.queries import run_figures
    from twin.ui.store import open_readonly

    engine, _ = open_readonly(planted_store["path"])
    row, kinds, terms = run_figures(engine, planted_store["b"])  # no summary stored
    _, _, last3 = run_figures(engine, planted_store["b"], terms_cap=3)
    engine.dispose()
    # rewards 1, 1 (ok_listing), -0.5, 1 (counterfeit)
    assert row.episodes == 4 and row.reward_mean == pytest.approx(0.625)
    assert row.reward_lo == pytest.approx(0.625 - 1.959964 * 0.75 / 2, abs=1e-5)
    assert [(k["kind"], k["episodes"], k["reward_mean"]) for k in kinds] == [
        ("counterfeit", 2, pytest.approx(0.25)),
        ("ok_listing", 2, pytest.approx(1.0)),
    ]
    assert dict(terms.means) == pytest.approx({"policy": 0.625, "submitted": 1.0})
    assert not terms.capped and terms.episodes == 4
    # the last three episodes: 1, -0.5, 1
    assert (last3.capped, last3.episodes) == (True, 3)
    assert dict(last3.means)["policy"] == pytest.approx(0.5)


def test_a_diverged_reward_term_does_not_break_the_run_page(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "nan.db")
    run_id = store.start_run("eval", "Catalog", "p")
    bad = episode(1, 0.0)
    bad.components = {"policy": float("nan"), "submitted": 1.0}
    store.add_episodes(run_id, [episode(0, 1.0), bad])  # stored as NaN: SQLite's JSON refuses it
    client = TestClient(create_app(tmp_path / "nan.db"), base_url="http://127.0.0.1")
    page = client.get(f"/runs/{run_id}")
    store.close()
    assert page.status_code == 200
    terms = page.text.split('id="terms"')[1].split("</section>")[0]
    assert re.search(r"<td>policy</td><td[^>]*>1.0000</td>", terms), terms  # NaN left out
    assert re.search(r"<td>submitted</td><td[^>]*>1.0000</td>", terms), terms


def test_failed_and_interrupted_runs_read_as_such(planted_store) -> None:
    path = planted_store["path"]
    store = RunStore(path)
    with pytest.raises(RuntimeError), store.track_run("eval", "Toy", "broken") as run:
        raise RuntimeError("policy server down")
    failed = run.id
    store.close()
    # a run whose writer exited without finishing it: its process is gone
    code = "from twin.store import RunStore; print(RunStore(%r).start_run('eval', 'Toy', 'killed'))"
    proc = subprocess.run(
        [sys.executable, "-c", code % str(path)], capture_output=True, text=True, check=True
    )
    gone = int(proc.stdout.split()[-1])
    client = TestClient(create_app(path), base_url="http://127.0.0.1")
    page = client.get("/").text
    assert 'status-failed">failed' in page.split(f'data-run="{failed}"')[1].split("</tr>")[0]
    assert (
        'status-interrupted">interrupted' in page.split(f'data-run="{gone}"')[1].split("</tr>")[0]
    )
    only = re.findall(r'<tr data-run="(\d+)">', client.get("/?status=interrupted").text)
    assert only == [str(gone)]
    assert re.findall(r'<tr data-run="(\d+)">', client.get("/?status=running").text) == []


def test_run_page_has_kinds_confusion_terms_and_episodes(client: TestClient, planted_store) -> None:
    page = client.get(f"/runs/{planted_store['a']}")
    assert page.status_code == 200
    kinds = page.text.split('id="kinds"')[1].split("</section>")[0]
    assert "ok_listing" in kinds and "counterfeit" in kinds
    confusion = page.text.split('id="confusion"')[1].split("</section>")[0]
    # truth ok: submitted ok once (case 0), counterfeit once (case 1); truth counterfeit: 1 and 1
    assert re.search(r"<th>ok</th><td[^>]*>1</td><td[^>]*>1</td>", confusion), confusion
    terms = page.text.split('id="terms"')[1].split("</section>")[0]
    assert "policy" in terms and "0.3000" in terms
    assert page.text.count('href="/episodes/') >= 4


def test_training_run_page_draws_each_curve(client: TestClient, planted_store) -> None:
    page = client.get(f"/runs/{planted_store['train']}")
    for name in ("rewards/total", "losses/loss", "losses/kl", "perf/tokens_per_s"):
        assert f'aria-label="{name}"' in page.text.split('id="more-curves"')[0]
    assert 'aria-label="batch/groups"' in page.text.split('id="more-curves"')[1]
    assert page.text.count("<polyline") == 6
    live = client.get(f"/runs/{planted_store['train']}/live")
    assert live.status_code == 200 and 'id="live"' in live.text


def test_episode_page_shows_calls_invalid_ones_reward_and_truth(
    client: TestClient, planted_store
) -> None:
    run = client.get(f"/runs/{planted_store['b']}").text
    ids = re.findall(r'href="/episodes/(\d+)"', run)
    page = client.get(f"/episodes/{ids[4]}").text  # case 2: an invalid call, then submit
    assert 'class="call call-invalid" data-call="lookup_brnd"' in page
    assert "unknown tool &#39;lookup_brnd&#39;" in page
    assert 'class="call call-ok" data-call="submit"' in page
    assert "policy: true &#39;counterfeit&#39;, submitted &#39;ok&#39;" in page  # reward note
    # the hidden truth comes after the transcript
    assert page.index('class="transcript"') < page.index('id="truth"')


def test_compare_finds_the_flipped_cases_and_kind_deltas(client: TestClient, planted_store) -> None:
    a, b = planted_store["a"], planted_store["b"]
    page = client.get(f"/compare?a={a}&b={b}").text
    flipped = page.split('id="flipped"')[1].split("</section>")[0]
    fixed, broken = flipped.split("Solved by A, not by B")
    assert 'data-case="Catalog/test/1"' in fixed and 'data-case="Catalog/test/3"' in fixed
    assert 'data-case="Catalog/test/2"' in broken and 'data-case="Catalog/test/0"' not in flipped
    deltas = page.split('id="kind-deltas"')[1]
    assert "ok_listing" in deltas and "+1.000" in deltas  # ok cases: 0.0 -> 1.0
    from twin.ui.queries import compare_runs

    capped = compare_runs(client.app.state.engine, a, b, 1.0, listed=1)
    assert (capped.fixed_total, len(capped.fixed), capped.fixed[0]["case"]) == (
        2,
        1,
        "Catalog/test/1",
    )
    side = client.get(f"/compare/case?a={a}&b={b}&case=Catalog/test/2").text
    assert side.count('class="transcript"') == 2 and "lookup_brnd" in side


def test_every_text_from_the_store_is_escaped(client: TestClient, planted_store) -> None:
    run_id = planted_store["xss"]
    pages = [client.get("/").text, client.get(f"/runs/{run_id}").text]
    ep = re.findall(r'href="/episodes/(\d+)"', pages[1])[0]
    pages.append(client.get(f"/episodes/{ep}").text)
    pages.append(client.get(f"/compare?a={run_id}&b={planted_store['a']}").text)
    pages.append(client.get(f"/runs/{planted_store['train']}").text)  # a metric's name
    for html in pages:
        assert "<script>window" not in html and "<img src=x" not in html
        assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
    assert "Title: mug &lt;script&gt;" in pages[2] and "I think &lt;script&gt;" in pages[2]
    scripts = re.findall(r"<script[^>]*>", "".join(pages))
    assert set(scripts) == {'<script src="/static/ui.js" defer>'}
    csp = client.get("/").headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp


def test_the_app_cannot_write_the_store(planted_store) -> None:
    path = planted_store["path"]
    before = _digest(path)
    app = create_app(path)
    client = TestClient(app, base_url="http://127.0.0.1")
    for url in ("/", f"/runs/{planted_store['a']}", "/compare?a=1&b=2", "/episodes/1"):
        assert client.get(url).status_code == 200
    assert client.post("/", data={"x": "1"}).status_code == 405
    with (
        pytest.raises(DBAPIError, match="readonly|read-only|query_only"),
        app.state.engine.begin() as conn,
    ):
        conn.execute(text("UPDATE runs SET status = 'failed'"))
    with pytest.raises(DBAPIError), app.state.engine.begin() as conn:
        conn.execute(text("CREATE TABLE x (a int)"))
    app.state.engine.dispose()
    assert _digest(path) == before
    # SQLite's shared-memory index of a WAL database may appear; its log holds no write
    wal = path.with_name(path.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    assert {r.status for r in RunStore(path).runs()} == {"finished"}


def test_postgres_store_is_opened_read_only(postgres_url: str) -> None:
    store = RunStore(postgres_url)
    diverged = episode(1, 0.0)
    diverged.components = {"policy": float("inf"), "submitted": 1.0}
    with store.track_run("eval", "Catalog", "heuristic") as run:
        run.add_episodes([episode(0, 1.0), diverged])  # no summary: the page counts them
    store.close()
    app = create_app(postgres_url)
    client = TestClient(app, base_url="http://127.0.0.1")
    assert client.get(f"/runs/{run.id}").status_code == 200
    assert client.get(f"/compare?a={run.id}&b={run.id}").status_code == 200
    with (
        pytest.raises(DBAPIError, match="read-only transaction"),
        app.state.engine.begin() as conn,
    ):
        conn.execute(text("DELETE FROM episodes"))
    app.state.engine.dispose()
    assert RunStore(postgres_url).count_episodes(run.id) == 2


def test_a_missing_or_foreign_store_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no run store at"):
        create_app(tmp_path / "nope.db")
    assert not (tmp_path / "nope.db").exists()  # never created
    other = tmp_path / "other.db"
    import sqlite3

    sqlite3.connect(other).execute("CREATE TABLE t (a int)")
    with pytest.raises(ConfigError, match="holds no run store"):
        create_app(other)


def test_bad_ids_and_parameters_are_clear_pages(client: TestClient) -> None:
    missing = client.get("/runs/999")
    assert missing.status_code == 404 and "no run with id 999" in missing.text
    assert client.get("/episodes/999").status_code == 404
    bad = client.get("/compare?a=1&b=x")
    assert bad.status_code == 400 and "b must be a whole number" in bad.text
    assert client.get("/compare/case?a=1&b=2").status_code == 400


def test_non_loopback_binding_needs_asking() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7")
    with pytest.raises(ConfigError, match="pass it with --host"):
        check_host("0.0.0.0", explicit=False)
    check_host("0.0.0.0", explicit=True)  # asked for: allowed
    check_host("127.0.0.1", explicit=False)


def test_serve_refuses_a_non_loopback_host_before_listening(planted_store) -> None:
    from twin.ui import serve

    with pytest.raises(ConfigError, match="not a loopback address"):
        serve(planted_store["path"], host="0.0.0.0", port=0)


def test_a_taken_port_is_a_one_line_error(planted_store) -> None:
    import socket

    from twin.ui import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve(planted_store["path"], port=port)


def test_requests_for_other_host_names_are_refused(client: TestClient) -> None:
    # a page on another site resolving its own name to 127.0.0.1 (DNS rebinding) gets nothing
    assert client.get("/", headers={"host": "evil.example"}).status_code == 400
    assert client.get("/", headers={"host": "localhost:8321"}).status_code == 200


def test_line_chart_scales_points_into_the_plot() -> None:
    chart = line_chart("loss", [(0, 1.0), (1, 0.5), (2, 0.0)], width=300, height=140)
    xy = [tuple(map(float, p.split(","))) for p in chart.points.split()]
    assert xy[0][0] == chart.left and xy[-1][0] == 300 - 8
    assert (
        xy[0][1] == chart.top and xy[-1][1] == 140 - chart.bottom
    )  # 1.0 at the top, 0 at the bottom
    many = line_chart(
        "r", [(float(i), float(i % 7)) for i in range(5000)], width=300, max_points=400
    )
    assert many.count <= 401 and many.points.split()[-1].startswith("292.0,")
    steps = line_chart("r", [(0, 0.0), (1, 1.0), (2, 0.5)])
    assert [label for _, label in steps.x_ticks] == ["0", "1", "2"]  # whole steps only
