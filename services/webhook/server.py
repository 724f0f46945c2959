"""The webhook's HTTPS server: POST /validate (AdmissionReview v1) answered by `review.review`, and
/healthz, /readyz. One review is a few hundred microseconds of CPU, run on the loop.

    server = WebhookServer(gates)
    port = await server.start("127.0.0.1", 0, ssl_context)
    ...
    await server.stop()
"""

from __future__ import annotations

import ssl

import msgspec
from aiohttp import web
from prometheus_client import Counter

from services.webhook.review import ReviewError, review
from shared.featuregates import FeatureGates
from shared.logs import get_logger

log = get_logger(__name__)

MAX_BODY = 3 * 1024 * 1024  # the API server's own request limit: a review is never larger
REVIEWS = Counter("gpu_dra_webhook_reviews_total", "AdmissionReviews answered, by outcome", ["outcome"])
_JSON = msgspec.json.Decoder()


class WebhookServer:
    def __init__(self, gates: FeatureGates) -> None:
        self.gates = gates
        self._runner: web.AppRunner | None = None

    async def validate(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            REVIEWS.labels("malformed").inc()
            return web.json_response(
                {"error": f"content type {request.content_type!r}; use application/json"}, status=415
            )
        try:
            answer = review(_JSON.decode(await request.read()), self.gates)
        except (msgspec.DecodeError, ReviewError) as exc:
            REVIEWS.labels("malformed").inc()
            return web.json_response({"error": f"not an AdmissionReview: {exc}"}, status=400)
        allowed = answer["response"]["allowed"]
        REVIEWS.labels("allowed" if allowed else "denied").inc()
        if not allowed:
            log.info("claim refused", uid=answer["response"]["uid"], reason=answer["response"]["status"]["message"])
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext) -> int:
        """Listen; returns the port (the one picked when `port` is 0)."""
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/validate", self.validate)
        app.router.add_get("/healthz", self.ok)
        app.router.add_get("/readyz", self.ok)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
