"""The web studio at `/`: plain HTML, CSS and JavaScript shipped in this package (serving/studio/), served as they
are: no build step, nothing fetched from elsewhere, so it works offline. The page speaks the API of docs/api.md."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STUDIO = Path(__file__).with_name("studio")
# The page loads its own files only; audio is made in the page (Web Audio, blob: downloads).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; "
                               "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def mount_studio(app: FastAPI) -> None:
    """`GET /` answers the studio's page, `/studio/...` its scripts and style sheet."""

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False, response_model=None)
    async def studio_page() -> FileResponse:
        return FileResponse(STUDIO / "index.html", media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    app.mount("/studio", StaticFiles(directory=STUDIO), name="studio")
