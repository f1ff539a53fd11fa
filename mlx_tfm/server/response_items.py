"""The input items of a kept response, as ``GET /v1/responses/{id}/input_items`` lists
them: each request item written as the spec's item resource (an id, a status, content in
its parts), fixed when the response is kept so that a page's ``after`` id finds its place
again; and the pages themselves (``limit``, ``order``, ``after``: the spec's
``ResponseItemList``). The request's own items are listed, not the earlier turns a
``previous_response_id`` brings in (those are the input items of the responses they came from)."""

from __future__ import annotations

import uuid

from .errors import invalid

# The spec's bounds of a page's size and its default.
DEFAULT_LIMIT, MAX_LIMIT = 20, 100

ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def part_text(part) -> str:
    return part if isinstance(part, str) else part.refusal or part.text


def message_content(item) -> list[dict]:
    """A message's content as the parts its role takes: the model's own are output text
    (or refusals), everyone else's input text."""
    parts = [item.content] if isinstance(item.content, str) else list(item.content)
    if item.role != "assistant":  # an image is listed as it came (input_image, its URL)
        return [{"type": "input_image", "image_url": part.image_url, "detail": part.detail or "auto"}
                if not isinstance(part, str) and part.type == "input_image" else
                {"type": "input_text", "text": part_text(part)} for part in parts]
    return [{"type": "refusal", "refusal": part.refusal} if not isinstance(part, str) and part.type == "refusal"
            else {"type": "output_text", "text": part_text(part), "annotations": [], "logprobs": []} for part in parts]


def item_fields(item) -> dict:
    """The fields of an item resource beyond its id, type and status (dispatch on the item's type)."""
    if item.type == "message":
        return {"role": item.role, "content": message_content(item)}
    if item.type == "function_call":
        return {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    if item.type == "function_call_output":
        output = item.output if isinstance(item.output, str) else "\n".join(part_text(part) for part in item.output)
        return {"call_id": item.call_id, "output": output}
    return {"summary": [{"type": "summary_text", "text": part.text} for part in item.summary],
            **({"content": [{"type": "reasoning_text", "text": part.text} for part in item.content]}
               if item.content else {})}


def item_resource(item) -> dict:
    """One request item as the spec's item resource (the id the client gave it, else a new one)."""
    resource_id = item.id or f"{ID_PREFIXES[item.type]}_{uuid.uuid4().hex}"
    return {"id": resource_id, "type": item.type, **item_fields(item), "status": "completed"}


def items_page(items: list[dict], query) -> dict:
    """One page of ``items`` (kept in the order they were given) as the query asks:
    ``order`` desc (the default: the last item first) or asc, the ``limit`` items after
    the item whose id is ``after``."""
    limit = query.get("limit", str(DEFAULT_LIMIT))
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIMIT:
        raise invalid("limit", f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"order must be 'asc' or 'desc', got {order!r}")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise invalid("after", f"no input item with id {query['after']!r} in this response")
        start = ids.index(query["after"]) + 1
    page = ordered[start:start + int(limit)]
    # (an empty page has no first or last item: null, as OpenAI's other lists answer)
    return {"object": "list", "data": page, "has_more": start + len(page) < len(ordered),
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


__all__ = ["item_resource", "items_page"]
