"""The operators' (and tests') HTTP routes over a cluster's instances (serving/fleet/cluster.py does the work)."""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dist_infer.serving.http.guard import ApiError, HttpGuard, error_body, error_response, install_guard
from dist_infer.serving.http.protocol import AddInstanceBody, MigrateBody, openapi_body
from dist_infer.serving.http.state import read_json


def add_admin_routes(app: FastAPI, cluster) -> None:
    """Operators' (and tests') view of the instances: their load and requests, a forced
    migration, draining, stopping, restarting and adding an instance (serving/fleet/cluster.py does the work)."""
    from dist_infer.serving.fleet.interface import AdminError

    if getattr(app.state, "http_guard", None) is None:  # an app not made by build_app: loopback-only admin
        install_guard(app, HttpGuard())

    def admin_error(exc: AdminError) -> JSONResponse:
        return error_response(ApiError(exc.status, str(exc)))

    @app.get("/admin/instances")
    async def instances():
        scaler = getattr(cluster, "autoscaler", None)
        return {
            "instances": cluster.describe_instances(),
            "ranks": cluster.describe_ranks(),
            **({"autoscale": scaler.describe()} if scaler else {}),
        }

    @app.post("/admin/migrate", openapi_extra=openapi_body(MigrateBody))
    async def migrate(request: Request):
        body = await read_json(request)
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("request_id"), str)
            or not isinstance(body.get("to_instance"), int)
        ):
            raise ApiError(400, 'the body must be {"request_id": "<id>", "to_instance": <index>}', "request_id")
        try:
            future = cluster.migrate_now(body["request_id"], body["to_instance"], body.get("mode", "live"))
        except AdminError as exc:
            return admin_error(exc)
        result = (await asyncio.wrap_future(future)).as_dict()
        if result["outcome"] != "ok":
            return JSONResponse(
                {
                    **error_body(409, f"the migration did not happen: {result['outcome']}: {result['message']}"),
                    "migration": result,
                },
                status_code=409,
            )
        return result

    def accepted(action: Callable[..., dict], *args) -> JSONResponse:
        """An admin action that starts something: 202 with the instance's description, or its error."""
        try:
            return JSONResponse(action(*args), status_code=202)
        except AdminError as exc:
            return admin_error(exc)

    @app.post("/admin/instances/{index}/drain")
    async def drain(index: int):
        return accepted(cluster.drain, index)

    @app.post("/admin/instances/{index}/stop")
    async def stop(index: int):
        return accepted(cluster.stop_instance, index)

    @app.post("/admin/instances/{index}/restart")
    async def restart(index: int):
        return accepted(cluster.restart_instance, index)

    @app.post("/admin/instances", openapi_extra=openapi_body(AddInstanceBody))
    async def add(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("layout"), str):
            raise ApiError(
                400, 'the body must be {"layout": "tp=1"} (one --instances item, e.g. decode:tp=2)', "layout"
            )
        return accepted(cluster.add_instance, body["layout"])
