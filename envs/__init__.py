"""The suite of twins. Each sub-package is built only on ``twin`` and ``rewards``.

Twins are found through the entry-point group ``twin.envs`` (see ``pyproject.toml``), so importing
this package imports no twin: ``twin.make("Returns")`` loads ``envs.returns`` on demand.
"""
