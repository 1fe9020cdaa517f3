"""The verifiers (v1) environment of every twinrl twin, under the taskset id ``twinrl-verifiers``.

verifiers imports a taskset by its id as a top-level module, so this module only re-exports
:mod:`integrations.verifiers_env` (the taskset, its harness and ``load_environment``)::

    vf-eval --env.taskset.id twinrl-verifiers --env.taskset.twin returns \\
        --env.agent.runtime.type subprocess --model MODEL --client.base-url URL -n 20
"""

from integrations.verifiers_env import TwinHarness, TwinTaskset, load_environment

__all__ = ["TwinHarness", "TwinTaskset", "load_environment"]
