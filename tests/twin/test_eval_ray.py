"""``evaluate(backend="ray")`` / ``twin eval --backend ray``: the same episodes, stored the same
way."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from twin.errors import ConfigError
from twin.evaluation import evaluate
from twin.policies import make_policy
from twin.registry import make_twin
from twin.store import RunStore
from twinrl_cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="pip install 'twinrl[ray]'")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _rows(store: RunStore, run_id: int) -> list[tuple]:
    """What an episode row says, without timings: sorted, so that arrival order does not count."""
    return sorted(
        (
            t.case_id,
            t.policy,
            t.reward,
            json.dumps(t.components, sort_keys=True),
            json.dumps(t.messages, sort_keys=True),
            t.num_turns,
            t.info.get("error"),
        )  # fmt: skip
        for t in store.episodes(run_id)
    )


def test_an_unknown_backend_is_refused_before_a_run_is_stored(tmp_path):
    twin = make_twin("catalog")
    store = RunStore(tmp_path / "runs.db")
    with pytest.raises(ConfigError, match="unknown eval backend 'dask'; choose one of local, ray"):
        evaluate(twin, make_policy("heuristic", twin), [("test", 0)], store=store,
                 backend="dask", progress=False)  # type: ignore[arg-type]  # fmt: skip
    assert store.runs() == []


def test_ray_backend_stores_the_episodes_of_the_local_backend(ray_cluster, tmp_path):
    twin = make_twin("catalog")
    cases = [("test", i) for i in range(16)]
    store = RunStore(tmp_path / "runs.db")
    local = evaluate(twin, make_policy("heuristic", twin), cases, store=store, progress=False)
    remote = evaluate(twin, make_policy("heuristic", twin), cases, store=store, progress=False,
                      backend="ray")  # fmt: skip
    assert remote.run_id != local.run_id
    assert _rows(store, remote.run_id) == _rows(store, local.run_id)
    assert [g.trajectories[0].case_id for g in remote.groups] == [
        f"Catalog/test/{i}" for i in range(16)
    ]
    keep = ("reward_mean", "episodes", "errors", "success_rate")
    assert {k: remote.summary.get(k) for k in keep} == {k: local.summary.get(k) for k in keep}
    assert store.run(remote.run_id).status == "finished"


@pytest.mark.slow
def test_twin_eval_backend_ray_equals_local_on_200_catalog_episodes(ray_cluster, tmp_path):
    """The acceptance check: same cases, same rewards, same summary, through the CLI."""
    db = tmp_path / "runs.db"
    summaries = {}
    for backend in ("local", "ray"):
        args = [
            "eval",
            "catalog",
            "--backend",
            backend,
            "--policy",
            "heuristic",
            "--episodes",
            "200",
        ]
        result = runner.invoke(app, [*args, "--store", str(db), "--json", "--no-progress"])
        assert result.exit_code == 0, result.output
        summaries[backend] = json.loads(result.stdout)
    local, remote = summaries["local"], summaries["ray"]
    store = RunStore(db)
    assert len(_rows(store, remote["run_id"])) == 200
    assert _rows(store, remote["run_id"]) == _rows(store, local["run_id"])
    for key in ("run_id", "store", "usage", "timings"):  # timings are wall-clock
        local.pop(key, None)
        remote.pop(key, None)
    assert remote == local
