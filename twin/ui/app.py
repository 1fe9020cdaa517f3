"""The ``twin ui`` web application: server-rendered pages over a read-only run store.

Pages (every one a plain GET URL, so any view can be shared by its link):

- ``/``: the runs table, filtered (``kind``, ``status``, ``q``) and sorted (``sort``, ``desc``);
- ``/runs/{id}``: a run's summary, per-kind table, decision confusion, reward-term means, its
  episodes (paged), and for a training run its curves per step (``/runs/{id}/live`` is the part
  a page polls while the run is going);
- ``/episodes/{id}``: the transcript, the reward breakdown and the hidden truth;
- ``/compare?a=A&b=B``: flipped cases and per-kind deltas of run B against run A;
  ``/compare/case?a=A&b=B&case=CASE``: the two transcripts of one case side by side.

Every string from the store goes through Jinja2's autoescaping, and the Content-Security-Policy
allows only this server's own script and style files, so text a model or a seller wrote is shown
and never run. Requests whose ``Host`` is not a loopback name are refused while the server is
bound to loopback (a web page elsewhere cannot reach it by DNS rebinding).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twin.store import RUN_KINDS, RUN_STATUSES
from twin.ui import queries as q
from twin.ui.charts import line_chart
from twin.ui.store import open_readonly
from twin.ui.transcript import pretty, transcript

__all__ = ["LOOPBACK_HOSTS", "create_app"]

_HERE = Path(__file__).parent
#: ``Host`` header names accepted while bound to loopback.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
#: Seconds between the polls of a running run's page.
POLL_S = 4
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


class _SecurityHeaders:
    """Adds the Content-Security-Policy and friends to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", _CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"x-frame-options", b"DENY"),
                ]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_HERE / "templates")),
        autoescape=True,  # every template, whatever its file name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=_num, pct=_pct, when=_when, pretty=pretty, duration=_duration)
    env.globals.update(RUN_KINDS=RUN_KINDS, RUN_STATUSES=RUN_STATUSES, qs=_qs)
    return env


#: Curves shown first on a training run's page (besides every ``rewards/...`` one).
# fmt: off
MAIN_CURVES = frozenset(
    {
    "losses/loss", "losses/kl", "policy/sampler_kl", "losses/clipfrac", "losses/clipfrac_low",
    "losses/clipfrac_high", "perf/tokens_per_s", "perf/sample_tokens_per_s",
    "perf/learner_tokens_per_s", "loss", "kl", "reward", "tokens_per_s",
}
)
# fmt: on


def _is_main_curve(name: str) -> bool:
    return name.startswith(("rewards/", "reward/")) or name in MAIN_CURVES


def _qs(request: Request, **changes: Any) -> str:
    """The page's query string with ``changes`` applied (a None or empty value drops a key)."""
    params = dict(request.query_params)
    for key, value in changes.items():
        if value is None or value == "":
            params.pop(key, None)
        else:
            params[key] = str(value)
    return "?" + urlencode(params) if params else "?"


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:+.{-digits}f}" if digits < 0 else f"{value:.{digits}f}"
    return str(value)


def _pct(value: Any) -> str:
    return "" if value is None else f"{100 * float(value):.1f}%"


def _when(value: dt.datetime | None) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _duration(row: q.RunRow) -> str:
    if row.started_at is None or row.finished_at is None:
        return ""
    seconds = (row.finished_at - row.started_at).total_seconds()
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _int(request: Request, name: str, default: int | None = None, low: int = 0) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise HTTPException(400, f"{name} must be a whole number, got {raw!r}") from None
    if value < low:
        raise HTTPException(400, f"{name} must be at least {low}, got {value}")
    return value


def _float(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise HTTPException(400, f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise HTTPException(400, f"{name} must be a finite number, got {raw!r}")
    return value


def _choice(request: Request, name: str, allowed: tuple[str, ...]) -> str | None:
    raw = request.query_params.get(name) or None
    if raw is not None and raw not in allowed:
        raise HTTPException(400, f"{name} must be one of {', '.join(allowed)}; got {raw!r}")
    return raw


class _Pages:
    """The page handlers, sharing the engine and the templates."""

    def __init__(self, engine: Engine, store_url: str, poll_s: float) -> None:
        self.engine = engine
        self.store_url = store_url
        self.env = _environment()
        self.env.globals["POLL_S"] = poll_s

    def render(self, name: str, request: Request, code: int = 200, **context: Any) -> Response:
        html = self.env.get_template(name).render(
            request=request, store_url=self.store_url, **context
        )
        return HTMLResponse(html, status_code=code)

    def _run(self, run_id: int) -> q.RunRow:
        row = q.run_row(self.engine, run_id)
        if row is None:
            raise HTTPException(404, f"no run with id {run_id} in this store")
        return row

    # -- pages ---------------------------------------------------------------------------------
    def runs(self, request: Request) -> Response:
        sort = _choice(request, "sort", q.RUN_SORTS) or "id"
        desc = request.query_params.get("desc", "1") != "0"
        filters = {
            "kind": _choice(request, "kind", RUN_KINDS),
            "status": _choice(request, "status", RUN_STATUSES),
            "text": (request.query_params.get("q") or "").strip() or None,
        }
        page = q.runs_page(
            self.engine, page=_int(request, "page", 1, low=1) or 1, sort=sort, desc=desc, **filters
        )
        return self.render("runs.html.jinja", request, page=page, sort=sort, desc=desc, **filters)

    def run(self, request: Request) -> Response:
        run_id = int(request.path_params["run_id"])
        all_terms = request.query_params.get("terms") == "all"
        found = q.run_figures(self.engine, run_id, None if all_terms else q.TERMS_CAP)
        if found is None:
            raise HTTPException(404, f"no run with id {run_id} in this store")
        row, kinds, terms = found
        kind = request.query_params.get("kind") or None
        step = _int(request, "step")
        order = _choice(request, "order", ("id", "reward", "-reward")) or "id"
        all_confusion = request.query_params.get("confusion") == "all"
        episodes = q.episodes_page(
            self.engine,
            row.id,
            page=_int(request, "page", 1, low=1) or 1,
            kind=kind,
            step=step,
            order=order,
        )
        return self.render(
            "run.html.jinja",
            request,
            row=row,
            kinds=kinds,
            terms=terms,
            confusion=q.confusion(self.engine, row, cap=None if all_confusion else q.CONFUSION_CAP),
            charts=self._charts(row),
            episodes=episodes,
            kind=kind,
            step=step,
            order=order,
        )

    def live(self, request: Request) -> Response:
        row = self._run(int(request.path_params["run_id"]))
        return self.render("_live.html.jinja", request, row=row, charts=self._charts(row))

    def _charts(self, row: q.RunRow) -> dict[str, list[tuple[str, list[Any]]]]:
        """The curves, split into the main ones (reward and its terms, loss, KL, clip
        fractions, tokens/s) and the rest."""
        main: list[tuple[str, list[Any]]] = []
        more: list[tuple[str, list[Any]]] = []
        for group, items in q.curves(self.engine, row.id):
            mine = [line_chart(n, p) for n, p in items if _is_main_curve(n)]
            rest = [line_chart(n, p) for n, p in items if not _is_main_curve(n)]
            if mine:
                main.append((group, mine))
            if rest:
                more.append((group, rest))
        return {"main": main, "more": more}

    def episode(self, request: Request) -> Response:
        episode_id = int(request.path_params["episode_id"])
        found = q.episode(self.engine, episode_id)
        if found is None:
            raise HTTPException(404, f"no episode with id {episode_id} in this store")
        run_id, step, traj = found
        before, after = q.neighbours(self.engine, run_id, episode_id)
        return self.render(
            "episode.html.jinja",
            request,
            run=self._run(run_id),
            episode_id=episode_id,
            step=step,
            t=traj,
            tr=transcript(traj),
            before=before,
            after=after,
        )

    def compare(self, request: Request) -> Response:
        a, b = _int(request, "a"), _int(request, "b")
        if a is None or b is None:
            return self.render("compare_pick.html.jinja", request, a=a, b=b)
        run_a, run_b = self._run(a), self._run(b)
        threshold = _float(request, "threshold", 1.0)
        result = q.compare_runs(self.engine, a, b, threshold)
        return self.render(
            "compare.html.jinja", request, a=run_a, b=run_b, c=result, threshold=threshold
        )

    def compare_case(self, request: Request) -> Response:
        a, b = _int(request, "a"), _int(request, "b")
        case_id = request.query_params.get("case")
        if a is None or b is None or not case_id:
            raise HTTPException(400, "compare/case needs a=RUN, b=RUN and case=CASE_ID")
        run_a, run_b = self._run(a), self._run(b)
        index = _int(request, "i", 0) or 0
        sides = []
        for run in (run_a, run_b):
            ids = q.case_episodes(self.engine, run.id, case_id)
            found = q.episode(self.engine, ids[min(index, len(ids) - 1)]) if ids else None
            traj = found[2] if found else None
            sides.append(
                {
                    "run": run,
                    "ids": ids,
                    "t": traj,
                    "tr": transcript(traj) if traj is not None else None,
                    "id": ids[min(index, len(ids) - 1)] if ids else None,
                }
            )
        return self.render(
            "compare_case.html.jinja",
            request,
            a=run_a,
            b=run_b,
            case_id=case_id,
            index=index,
            sides=sides,
        )

    async def error(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        return self.render("error.html.jinja", request, code=status, status=status, detail=detail)


def _disposing(engine: Engine) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        engine.dispose()

    return lifespan


def create_app(
    store: str | os.PathLike[str] | None = None,
    *,
    allowed_hosts: list[str] | None = None,
    poll_s: float = POLL_S,
) -> Starlette:
    """The web application over the run store ``store``, opened read-only.

    Args:
        store: SQLAlchemy URL or SQLite path; None: ``$TWINRL_STORE`` or ``runs/twinrl.db``.
        allowed_hosts: ``Host`` header names served; default the loopback names
            (:data:`LOOPBACK_HOSTS`); ``["*"]`` serves any.
        poll_s: Seconds between the polls of a running run's page.

    Raises:
        ConfigError: the store cannot be opened (see :func:`twin.ui.store.open_readonly`).
    """
    engine, shown = open_readonly(store)
    pages = _Pages(engine, shown, poll_s)
    routes = [
        Route("/", pages.runs, name="runs"),
        Route("/runs/{run_id:int}", pages.run, name="run"),
        Route("/runs/{run_id:int}/live", pages.live, name="live"),
        Route("/episodes/{episode_id:int}", pages.episode, name="episode"),
        Route("/compare", pages.compare, name="compare"),
        Route("/compare/case", pages.compare_case, name="compare_case"),
        Mount("/static", StaticFiles(directory=str(_HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(_SecurityHeaders),
            Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts or list(LOOPBACK_HOSTS)),
        ],
        exception_handlers={HTTPException: pages.error, 500: pages.error},
        lifespan=_disposing(engine),
    )
    app.state.engine = engine
    app.state.store_url = shown
    return app
