"""A throwaway PostgreSQL server for the run-store tests (and for trying the store by hand).

The server lives in a temporary folder: ``initdb`` there, a free loopback port, the unix socket
in the same folder, listening on 127.0.0.1 only, trust authentication (nothing but this machine
can reach it), and everything deleted on :meth:`PostgresServer.stop`. PostgreSQL refuses to run
as root, so under root the server runs as ``nobody`` (``runuser``) and the folder is its own.

Used three ways:

- ``tests/conftest.py`` starts one per test session (the ``postgres_url`` fixture);
- ``python tests/pg_server.py ensure`` (the Makefile's ``pg-server-deps``): find ``initdb`` /
  ``pg_ctl``; when missing, as root with apt, ``apt-get install postgresql``; never fails;
- ``python tests/pg_server.py run -- CMD ...``: start a server, run ``CMD`` with
  ``$TWINRL_TEST_POSTGRES_URL`` set to its database, stop the server, exit with ``CMD``'s status.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

#: Environment variable naming an existing server's database for the tests (skips our own).
URL_ENV = "TWINRL_TEST_POSTGRES_URL"
#: Why the PostgreSQL variants of the tests skip when there is no server.
NO_SERVER = "no PostgreSQL: apt-get install postgresql, or set TWINRL_TEST_POSTGRES_URL"
#: The unprivileged user the server runs as when we are root.
SERVER_USER = "nobody"


def find_bin_dir() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``: on ``$PATH``, else Debian's
    ``/usr/lib/postgresql/<version>/bin`` (newest version); None when neither has them."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in Path(p).parts[-3].split(".")],
    )
    for initdb in reversed(versions):
        if (Path(initdb).parent / "pg_ctl").exists():
            return Path(initdb).parent
    return None


def ensure_binaries() -> Path | None:
    """Find the server binaries, installing Debian's ``postgresql`` with apt when they are
    missing and we are root with apt. Prints what it does and why it could not; never raises."""
    found = find_bin_dir()
    if found is not None:
        print(f"PostgreSQL for the run-store tests: {found}")
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        why = "not root" if os.geteuid() != 0 else "no apt-get"
        print(f"PostgreSQL not found and not installed ({why}); the PostgreSQL store tests skip")
        return None
    print("PostgreSQL not found: installing Debian's postgresql with apt-get (run-store tests)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "postgresql"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            print(f"`{' '.join(cmd)}` failed; the PostgreSQL store tests skip:")
            for line in tail:
                print(f"    {line}")
            return None
    found = find_bin_dir()
    print(f"PostgreSQL installed: {found}" if found else "apt-get ran but no initdb was found")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """One throwaway PostgreSQL server: :meth:`start`, :meth:`create_database`, :meth:`stop`.

    Args:
        bin_dir: Folder of ``initdb`` / ``pg_ctl`` (default: :func:`find_bin_dir`).
        timezone: The server's ``TimeZone``. Not UTC on purpose: a timestamp written without
            its zone would come back shifted, so the tests see it.
    """

    def __init__(self, bin_dir: Path | None = None, *, timezone: str = "Pacific/Chatham") -> None:
        found = bin_dir or find_bin_dir()
        if found is None:
            raise RuntimeError(NO_SERVER)
        self.bin_dir = Path(found)
        self.timezone = timezone
        self.root: Path | None = None
        self.port = 0
        self._counter = 0

    @property
    def data_dir(self) -> Path:
        assert self.root is not None, "server not started"
        return self.root / "data"

    def _cmd(self, *args: str) -> list[str]:
        """A command run as the server's user: ``nobody`` under root, else ourselves."""
        if os.geteuid() == 0:
            return ["runuser", "-u", SERVER_USER, "--", *args]
        return list(args)

    def _run(self, *args: str, timeout: float = 120) -> None:
        proc = subprocess.run(
            self._cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=self.root
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(args)}` failed ({proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}{self._log_tail()}"
            )

    def _log_tail(self) -> str:
        log = self.root / "server.log" if self.root else None
        if log is None or not log.exists():
            return ""
        return "\nserver log:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])

    def start(self) -> str:
        """Create the cluster and start the server; return the URL of its ``postgres`` database."""
        self.root = Path(tempfile.mkdtemp(prefix="twinrl-pg-", dir="/tmp"))
        if os.geteuid() == 0:
            shutil.chown(self.root, SERVER_USER)
        try:
            self._run(
                str(self.bin_dir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            )
            for attempt in range(3):  # the free port may be taken between asking and binding
                self.port = _free_port()
                options = (
                    f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} "
                    f"-c max_connections=200 -c fsync=off -c synchronous_commit=off "
                    f"-c full_page_writes=off -c timezone={self.timezone}"
                )
                try:
                    self._run(
                        str(self.bin_dir / "pg_ctl"),
                        "-D",
                        str(self.data_dir),
                        "-l",
                        str(self.root / "server.log"),
                        "-w",
                        "-t",
                        "60",
                        "-o",
                        options,
                        "start",
                    )
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
        except BaseException:
            self.stop()
            raise
        return self.url("postgres")

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "twinrl_test") -> str:
        """A new empty database; returns its URL."""
        self._counter += 1
        name = f"{prefix}_{os.getpid()}_{self._counter}"
        create_database(self.url("postgres"), name)
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (immediately: it holds nothing worth keeping) and delete its folder."""
        if self.root is None:
            return
        if (self.data_dir / "postmaster.pid").exists():
            subprocess.run(
                self._cmd(
                    str(self.bin_dir / "pg_ctl"),
                    "-D",
                    str(self.data_dir),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ),
                capture_output=True,
                timeout=60,
                cwd=self.root,
            )
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None


def _admin_connect(admin_url: str):  # noqa: ANN202 - psycopg is optional
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    return psycopg.connect(
        host=url.host,
        port=url.port,
        user=url.username,
        password=url.password,
        dbname=url.database,
        autocommit=True,
    )


def create_database(admin_url: str, name: str) -> None:
    """``CREATE DATABASE name`` through the server of ``admin_url`` (its user needs CREATEDB)."""
    with _admin_connect(admin_url) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(admin_url: str, name: str) -> None:
    """``DROP DATABASE name``, closing whatever connections a test left open to it."""
    with _admin_connect(admin_url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ensure", help="find (or apt-get install) the server binaries; never fails")
    run = sub.add_parser("run", help=f"run a command with a throwaway server (${URL_ENV})")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    if args.command == "ensure":
        ensure_binaries()
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("run needs a command after --")
    # a killed `run` still stops its server (SIGTERM would skip the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    server = PostgresServer()
    try:
        server.start()
        url = server.create_database("twinrl")
        print(f"{URL_ENV}={url}", flush=True)
        return subprocess.run(cmd, env=dict(os.environ, **{URL_ENV: url})).returncode
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
