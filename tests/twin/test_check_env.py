"""Gymnasium's own checker passes, without a single warning, on every registered twin."""

from __future__ import annotations

import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import twin


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Twins that cache their world on disk write it under a tmp dir, never ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TWINRL_CACHE", str(tmp_path_factory.mktemp("twinrl-cache")))
        yield


@pytest.mark.parametrize("twin_id", [s.id for s in twin.list_twins()])
def test_check_env_passes_without_warnings(twin_id: str) -> None:
    env = gymnasium.make(twin_id, render_mode="ansi")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # check_env only warns: make every warning fail the test
        check_env(env.unwrapped)
    env.close()


def test_every_twin_in_the_project_is_registered() -> None:
    ids = {s.id for s in twin.list_twins()}
    assert {"twin/Catalog-v0", "twin/Returns-v0", "twin/Toy-v0"} <= ids
