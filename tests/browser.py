"""The headless browser of the ``twin ui`` tests: Debian's chromium, driven by Playwright.

Playwright never downloads a browser here: the tests launch the system's chromium through its
``executable_path``. Used two ways:

- ``tests/ui/test_browser.py`` calls :func:`find_chromium` and skips with :data:`NO_BROWSER` when
  there is none (or when the ``playwright`` package is missing);
- ``python tests/browser.py ensure`` (the Makefile's ``browser-deps``): find chromium; when
  missing, as root with apt, ``apt-get install chromium``; never fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

#: Why the browser tests skip when there is no chromium.
NO_BROWSER = "no chromium: apt-get install chromium (or `make browser-deps` as root)"
#: Where Debian's package puts the browser, then other names it goes by.
CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
#: Chromium flags for a container (no user namespaces for the sandbox, small /dev/shm).
LAUNCH_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]


def find_chromium() -> str | None:
    """The path of a chromium executable, or None."""
    for name in CANDIDATES:
        path = name if os.path.isabs(name) and os.access(name, os.X_OK) else shutil.which(name)
        if path:
            return path
    return None


def ensure_chromium() -> str | None:
    """Find chromium, installing Debian's ``chromium`` with apt when it is missing and we are
    root with apt. Prints what it does and why it could not; never raises."""
    found = find_chromium()
    if found is not None:
        print(f"chromium for the twin ui browser tests: {found}")
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        why = "not root" if os.geteuid() != 0 else "no apt-get"
        print(f"chromium not found and not installed ({why}); the twin ui browser tests skip")
        return None
    print("chromium not found: installing Debian's chromium with apt-get (twin ui browser tests)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            print(f"`{' '.join(cmd)}` failed; the twin ui browser tests skip:")
            for line in tail:
                print(f"    {line}")
            return None
    found = find_chromium()
    print(f"chromium installed: {found}" if found else "apt-get ran but no chromium was found")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ensure", help="find (or apt-get install) chromium; never fails")
    parser.parse_args(argv)
    ensure_chromium()
    return 0


if __name__ == "__main__":
    sys.exit(main())
