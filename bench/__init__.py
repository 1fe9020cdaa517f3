"""Benchmarks, the 9B rehearsal and the device checks: above the libraries, run by ``twin bench``.

No module of ``twin``, ``envs``, ``rewards``, ``trainer`` or ``integrations`` imports this package
(an import-linter contract in ``pyproject.toml``).
"""
