"""Unit-test rewards against hand-written rollouts, before spending a GPU hour.

A rollout file (``*.rollouts.yaml``) names a twin and lists cases::

    twin: Catalog                 # made by the registry: twin.registry.make_shared_twin
    tolerance: 1.0e-6             # optional, per file (a case may set its own)
    cases:
      - name: gold                # the oracle's answer must score the maximum
        truth: {category_id: aa-1, attributes: {color: red}, verdict: ok, signals: []}
        submit: {category_id: aa-1, attributes: {color: Red}, verdict: ok, reason: looks fine}
        expect: {total: 1.0, components: {category: 1, attributes: 1, policy: 1}}
      - name: miss, two bad calls
        truth: {category_id: aa-1, attributes: {}, verdict: counterfeit, signals: [typosquat]}
        submit: {category_id: aa-1, attributes: {}, verdict: ok, reason: ""}
        invalid_calls: 2
        expect: {total: "0.3 + 0.3 - 0.4 - 0.02", components: {policy: -1, penalty: 0.02}}
      - name: no submit
        truth: {category_id: aa-1, attributes: {}, verdict: ok, signals: []}
        submit: null
        expect: {total: -0.4}

A case gives either ``submit`` (the terminal call's arguments, or null for "never submitted")
with an optional ``invalid_calls: N``, or ``turns``: the assistant turns (raw text or message
dicts) replayed through the real environment (``case: {split, index}`` picks the case the
episode runs on; the file's ``truth`` replaces that case's truth when scoring; without a
``truth`` the case's own is used). Expected values are numbers or arithmetic such as ``"5/7"``;
``total: max`` means the reward's upper bound; ``expect: 0.2`` is short for ``{total: 0.2}``.

A file's ``reward: module:attr`` is imported only from the reward library (``rewards``) and
the packages of registered twins (built in, or installed through the ``twin.envs`` entry
points): a rollout file is data, and naming any module would let it run any code. Other modules
need an explicit ``allow_import=True`` (``twin reward test --allow-import``,
``pytest --rollouts-allow-import``).

Run ``twin reward test FILE...`` (:func:`cli_main`), or ``pytest FILE...`` (the plugin in
:mod:`rewards.pytest_plugin` collects each case as a test item).

The kit sits above the rest of the reward library: it makes twins, but only through the
registry's public API (:mod:`twin.registry`), and replays episodes through
:class:`twin.env.TwinEnv`. Its modules: ``schema`` (the file format and loader), ``resolve``
(which reward, which twin), ``replay`` (scoring the cases), ``report`` (the table and the CLI).
Nothing else in ``rewards/`` imports it (``pyproject.toml``, ``[tool.importlinter]``).
"""

from rewards.testing.replay import (
    CaseOutcome,
    check_rollout_file,
    replay_turns,
    run_rollout_file,
    score_case,
)
from rewards.testing.report import cli_main, render_outcomes
from rewards.testing.resolve import (
    Scorer,
    clear_cache,
    register_reward,
    resolve_scorer,
    rollout_twin,
    trusted_reward_packages,
    unregister_reward,
)
from rewards.testing.schema import (
    DEFAULT_TOLERANCE,
    CaseRef,
    Expect,
    RolloutCase,
    RolloutFile,
    load_rollout_file,
)

__all__ = [
    "DEFAULT_TOLERANCE",
    "CaseOutcome",
    "CaseRef",
    "Expect",
    "RolloutCase",
    "RolloutFile",
    "Scorer",
    "check_rollout_file",
    "clear_cache",
    "cli_main",
    "load_rollout_file",
    "register_reward",
    "render_outcomes",
    "replay_turns",
    "resolve_scorer",
    "rollout_twin",
    "run_rollout_file",
    "score_case",
    "trusted_reward_packages",
    "unregister_reward",
]
