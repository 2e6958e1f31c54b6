"""Operator routes for scheduled jobs: every job, and removing any stored one.

``GET /admin/cron`` lists every job the gateway knows (configured, added
through the API, created from a chat) with its origin, the principal it is
counted against, its next run and whether it is paused; ``DELETE
/admin/cron/{job_id}`` removes a stored job whoever made it. Both need the
access token when one is configured, like every admin route.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from chatlane.errors import ConfigError
from chatlane.identity import build_session_key
from chatlane.scheduling.chat import principal_of, when_text
from chatlane.scheduling.cron import Job

if TYPE_CHECKING:
    from chatlane.hub import Hub
    from chatlane.scheduling.loop import Scheduler

Refusal = Callable[[Request], JSONResponse | None]
"""The admin routes' token check: a request's refusal (401, 429), or ``None`` to serve it."""


def routes(hub: Hub, refusal: Refusal) -> Sequence[BaseRoute]:
    """The cron routes, bound to ``hub``, behind the admin routes' ``refusal``."""

    async def listing(request: Request) -> JSONResponse:
        refused = refusal(request)
        if refused is not None:
            return refused
        scheduler = hub.gateway.scheduler
        if scheduler is None:
            return JSONResponse({"jobs": []})
        await scheduler.sync()
        return JSONResponse({"jobs": [job_summary(scheduler, j) for j in scheduler.list_jobs()]})

    async def remove(request: Request) -> JSONResponse:
        refused = refusal(request)
        if refused is not None:
            return refused
        job_id = request.path_params["job_id"]
        scheduler = hub.gateway.scheduler
        try:
            removed = scheduler is not None and await scheduler.remove_job(job_id)
        except ConfigError as error:
            return JSONResponse({"error": str(error)}, status_code=409)
        if not removed:
            return JSONResponse({"error": f"no job {job_id!r}"}, status_code=404)
        return JSONResponse({"removed": job_id})

    return [
        Route("/admin/cron", listing, methods=["GET"]),
        Route("/admin/cron/{job_id:path}", remove, methods=["DELETE"]),
    ]


def job_summary(scheduler: Scheduler, job: Job) -> dict[str, Any]:
    """What ``chatlane cron list`` shows for one job."""
    origin = job.origin
    policy = scheduler.gateway.settings.key_policy
    next_run = scheduler.next_run(job.id)
    return {
        "id": job.id,
        "schedule": job.schedule,
        "prompt": job.prompt,
        "target": job.target,
        "session": None if origin is None else build_session_key(origin, policy),
        "principal": None if origin is None else principal_of(origin),
        "configured": scheduler.is_configured(job.id),
        "paused": scheduler.is_paused(job),
        "next_run": next_run,
        "next_run_text": when_text(scheduler, next_run),
    }
