"""Serving ``twin ui``: where it may listen, and running it with uvicorn.

The server listens on 127.0.0.1 unless the caller names another address explicitly
(``twin ui --host``): a run store holds prompts, model outputs and the hidden truth of every
case, which is not for the network by default. :func:`check_host` refuses a non-loopback
address that was not asked for.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable

from twin.errors import ConfigError

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "check_host", "is_loopback", "serve"]

#: Where ``twin ui`` listens unless ``--host`` says otherwise.
DEFAULT_HOST = "127.0.0.1"
#: Its default port.
DEFAULT_PORT = 8321


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) means this machine only.

    A name counts as loopback only when every address it resolves to is a loopback address.
    """
    bare = host.strip("[]")
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, None)
    except socket.gaierror:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses
    )


def check_host(host: str, *, explicit: bool) -> None:
    """Refuse to listen on ``host`` when it is not loopback and was not asked for explicitly.

    Raises:
        ConfigError: ``host`` is not a loopback address and ``explicit`` is False.
    """
    if not is_loopback(host) and not explicit:
        raise ConfigError(
            f"twin ui listens on loopback only unless told otherwise; {host!r} is not a loopback "
            "address: pass it with --host to serve the run store to the network"
        )


def serve(
    store: str | os.PathLike[str] | None = None,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    explicit_host: bool = False,
    log_level: str = "warning",
    on_ready: Callable[[str], object] | None = None,
) -> None:
    """Serve the run store ``store`` read-only at ``http://host:port/`` until interrupted.

    Args:
        store: SQLAlchemy URL or SQLite path; None: ``$TWINRL_STORE`` or ``runs/twinrl.db``.
        host: Address to listen on.
        port: Port (0: any free one).
        explicit_host: The user named ``host`` (``--host``): a non-loopback one is allowed.
        log_level: uvicorn's log level.
        on_ready: Called with the URL once the server listens.

    Raises:
        ConfigError: a non-loopback ``host`` not asked for, or a store that cannot be opened.
    """
    check_host(host, explicit=explicit_host)
    import uvicorn

    from twin.ui.app import LOOPBACK_HOSTS, create_app

    loopback = is_loopback(host)
    app = create_app(store, allowed_hosts=list(LOOPBACK_HOSTS) if loopback else ["*"])
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    server = uvicorn.Server(config)
    try:
        sock = config.bind_socket()
    except SystemExit:  # uvicorn exits when the port is taken: say so in one line
        raise ConfigError(
            f"cannot listen on {host}:{port}: address in use or not available"
        ) from None
    sock.listen(128)  # connections made as soon as the URL is printed wait for the server
    bound_port = sock.getsockname()[1]
    shown_host = f"[{host}]" if ":" in host else host
    if on_ready is not None:
        on_ready(f"http://{shown_host}:{bound_port}/")
    server.run(sockets=[sock])
