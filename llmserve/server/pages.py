"""OpenAI's cursor pagination of a list (input items, files, batches): `limit` items after the one named `after`."""

from __future__ import annotations

from llmserve.server.errors import APIError


def cursor_page(items: list[dict], limit: int, after: str | None, what: str = "object") -> dict:
    """items in the order listed; `after`: the id of the last item the client saw (400 if there is none such)."""
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after: no {what} with id {after!r}", param="after")
        items = items[ids.index(after) + 1:]
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}
