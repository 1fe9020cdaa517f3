"""``twin check TWIN``: :func:`doctor` plays a twin and reports whether it is solvable and free
of shortcuts (``doctor("Returns").assert_ok()``). :func:`check_twin` (the contract, like
Gymnasium's ``check_env``) is re-exported here beside it.

- :mod:`twin.doctor.runner`: :func:`doctor` itself, the contract and determinism checks.
- :mod:`twin.doctor.checks`: the checks that play the twin (solvable, reference, degenerate,
  shortcut, overlap).
- :mod:`twin.doctor.play`: playing episodes for the checks, and the degenerate policies.
- :mod:`twin.doctor.audit`: leak scans and the bag-of-words shortcut audit.
- :mod:`twin.doctor.report`: :class:`Report`, its rows and thresholds.
"""

from twin.contract import TwinCheckError, check_twin
from twin.doctor.report import CheckRow, Report
from twin.doctor.runner import case_digest, doctor

__all__ = ["CheckRow", "Report", "TwinCheckError", "case_digest", "check_twin", "doctor"]
