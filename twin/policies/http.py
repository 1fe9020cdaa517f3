"""One TLS context per process for every httpx client and transport twinrl makes.

httpx builds a new ``ssl.SSLContext`` for each client or transport created without one, and
loads certifi's CA bundle into it: about 70 ms of CPU every time (measured on the 2-core
development machine, httpx 0.28). The trainer makes clients per request (adapter loads, sync
probes, every sampling call), and in the async learner those milliseconds ran beside the update
on the learner's core: a thread creating one client every 50 ms slowed a LoRA update 1.7x. Passing
``verify=tls_context()`` builds the context once and keeps certificate checks as httpx does them
(``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` are read, as httpx reads them).

::

    import httpx
    from twin.policies.http import tls_context

    with httpx.Client(verify=tls_context(), timeout=30) as client:
        client.get("http://127.0.0.1:8000/health")
"""

from __future__ import annotations

import functools
import ssl

__all__ = ["tls_context"]


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's verified TLS context (built on first use, then shared; thread-safe to
    share)."""
    import httpx

    return httpx.create_ssl_context()
