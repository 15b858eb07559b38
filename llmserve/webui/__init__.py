"""The web playground: static HTML, CSS and JavaScript in `static/`, served at `/` by `llmserve serve` (and by any
other FastAPI front that calls `mount_webui`). It talks to the same public API a client does (/v1/models,
/v1/chat/completions, /metrics), so it needs nothing from the server beyond these files."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"

# Defence in depth beside the page's own escaping: only our own files may run or style the page, and it may only
# talk to this server. A model answer that slipped markup into the DOM still could not run script.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class _StaticWithHeaders(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers.update(_HEADERS)
        return response


def mount_webui(app: FastAPI) -> None:
    """`/` is the playground; its assets live under /webui/."""
    app.mount("/webui", _StaticWithHeaders(directory=STATIC_DIR), name="webui")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC_DIR / "index.html", headers=_HEADERS)

    @app.get("/index.html", include_in_schema=False)
    async def index_alias():
        return RedirectResponse("/")
