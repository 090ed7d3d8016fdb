"""The web page at `/`: a chat and a live engine view, written against the public API only (it is an example
client too). Its files are static, shipped in the package (`tokenmill/assets/web/`), served without the key (they
hold no data: guard.py); every API call the page makes carries the key the user gives it. `--no-web-ui` leaves
both routes out.

Must not import torch.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from tokenmill.server.guard import WEB_UI_PREFIX

WEB_DIR = Path(__file__).resolve().parent.parent / "assets" / "web"
# The page runs only its own files: no inline script, nothing from another origin (it works offline too)
HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'",
    "cache-control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html", headers=HEADERS)


def install(app: FastAPI) -> None:
    """The page at `/` and its files under `/ui/`."""
    app.include_router(router)
    app.mount(WEB_UI_PREFIX.rstrip("/"), StaticFiles(directory=WEB_DIR), name="web-ui")
