"""What operators and clients read about the server: /health, /ready (the readiness probe), /metrics
(Prometheus) and /v1/models (with max_model_len and the drafter's kind, state and license)."""

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.metrics import GatewayMetrics
from gateway.readiness import ReadinessProbe
from gateway.verify_client import VerifyClient


def add_service_routes(app: FastAPI, settings, client: VerifyClient, probe: ReadinessProbe, metrics: GatewayMetrics,
                       authorize: Callable[[Request], None]) -> None:
    """settings: the app's GatewaySettings."""

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        ok, body = probe.status()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        metrics.verify_up.set(1 if client.alive else 0)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        heartbeat = client.last_heartbeat
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": 0, "owned_by": "dflash-serve",
            "root": settings.model_name, "parent": None, "max_model_len": settings.max_model_len,
            "drafter": {"kind": heartbeat.drafter_kind if heartbeat else "unknown",
                        "available": bool(heartbeat and heartbeat.drafter_available),
                        "license": settings.drafter_license},
        }]}
