"""Request bodies as the HTTP API reads them: their encoding and keys, the song request's fields and types, and the
error messages for each way a body can be wrong (docs/api.md). Their size is body_limits' to check."""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Awaitable, Callable, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from starlette.exceptions import HTTPException

from .. import contract
from ..prompt import MAX_CAPTION_CHARS, MAX_LYRICS_CHARS, MAX_STEPS
from .audio_io import OUTPUT_RATES
from .encoders import FORMATS

MAX_ERRORS = 5  # an error message names at most this many problems, then says how many more there are
# The caption's and lyrics' length limits as /openapi.json states them (prompt.py checks them).
CAPTION_LENGTH = {"maxLength": MAX_CAPTION_CHARS}
LYRICS_LENGTH = {"maxLength": MAX_LYRICS_CHARS}


def integer_of(choices: tuple[int, ...]) -> Any:
    """A field type taking one of `choices` as a JSON integer only (a Literal alone takes 32000.0 as 32000)."""

    def integer(value: Any) -> Any:
        if type(value) is not int:
            raise ValueError(f"must be an integer, one of {', '.join(map(str, choices))}")
        return value

    return Annotated[Literal[choices], BeforeValidator(integer)]  # type: ignore[valid-type]


def refused(reasons: dict[str, str], allowed: tuple = (None,)) -> Callable[[Any, ValidationInfo], Any]:
    """A validator for fields this model cannot honour: any value but the `allowed` ones is refused with the field's
    reason."""

    def refuse(value: Any, info: ValidationInfo) -> Any:
        if value not in allowed:
            raise ValueError(reasons[info.field_name])
        return value

    return refuse


class SongBody(BaseModel):
    """POST /v1/songs. Types are strict (a string is not a number, a bool is not an int); unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    caption: str = Field(json_schema_extra=CAPTION_LENGTH)
    lyrics: str = Field(json_schema_extra=LYRICS_LENGTH)
    duration: float = Field(30.0, gt=0, le=contract.MAX_DURATION_S, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=contract.SEED_LIMIT)
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    format: Literal[FORMATS] = "wav"  # type: ignore[valid-type]
    sample_rate: integer_of(OUTPUT_RATES) = contract.SAMPLE_RATE  # type: ignore[valid-type]
    stream: bool = True
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9._~-]{1,128}$")  # default: a fresh uuid4 hex

    @field_validator("id")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        if value in (".", ".."):
            raise ValueError("an id of '.' or '..' cannot be reached at /v1/songs/{id} (clients resolve it away)")
        return value


class _RepeatedKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def json_object_of(model: type[BaseModel]) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: the body is a plain JSON object as `model` takes it (below)."""

    async def plain_json_object(request: Request) -> None:
        await check_json_object(request, model)

    return plain_json_object


async def check_json_object(request: Request, model: type[BaseModel]) -> None:
    """The body is UTF-8 with each key once: the JSON parser alone takes UTF-16 and UTF-32 too, and keeps the
    last value of a repeated key. A UTF-8 byte-order mark is ignored, here as by that parser, so these checks see
    the object it will validate. An object with more keys than `model` has is refused here, in one short
    message, before validation would build (and send back) an error per key. (Bodies it cannot parse are its to
    report: it ran first.)"""
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise HTTPException(400, not_utf8(exc)) from None
    except _RepeatedKey as exc:
        raise HTTPException(400, f"the body names {exc.args[0]!r:.80} more than once") from None
    except ValueError:
        return
    if isinstance(body, dict) and len(body) > len(model.model_fields):
        unknown = [key for key in body if key not in model.model_fields]
        named = ", ".join([f"{key!r:.40}" for key in unknown[:MAX_ERRORS]] + ["..."] * (len(unknown) > MAX_ERRORS))
        raise HTTPException(400, f"the body has {len(unknown)} unknown keys ({named}); the request takes "
                                 f"{', '.join(accepted_fields(model))}")


def not_utf8(exc: UnicodeDecodeError) -> str:
    """The message for a body that is not UTF-8 (the JSON parser reads UTF-8 only here)."""
    return (f"the body is not UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start}): send JSON as UTF-8 "
            "text")


@functools.cache
def accepted_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The keys a body of `model` may give: its fields less those taken only to be refused (left out of its JSON
    schema, as /openapi.json shows it)."""
    return tuple(model.model_json_schema()["properties"])


def body_model(scope: dict[str, Any]) -> type[BaseModel] | None:
    """The body model of the request's route (FastAPI leaves the route in the scope), None for a route without one."""
    field = getattr(scope.get("route"), "body_field", None)
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _model_at(model: type[BaseModel] | None, keys: tuple) -> type[BaseModel] | None:
    """The model of the object at `keys` within a body of `model` (None where that is no model's)."""
    for key in keys:
        field = model.model_fields.get(key) if model is not None and isinstance(key, str) else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return model


OBJECT_EXPECTED = ("model_attributes_type", "dict_type", "model_type")  # pydantic's types of "not an object"
BOUND_WORDS = (("gt", "greater than"), ("ge", "at least"), ("lt", "less than"), ("le", "at most"))


def json_media_type(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON: application/json or application/*+json."""
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _past_float(model: type[BaseModel] | None, keys: tuple, value: int) -> str:
    """An integer too large for a float field (pydantic says only "a valid number"): its size and the field's
    bounds."""
    parent = _model_at(model, keys[:-1])
    field = parent.model_fields.get(keys[-1]) if parent is not None and keys else None
    bounds = [f"{words} {getattr(rule, name):g}" for rule in (field.metadata if field else ())
              for name, words in BOUND_WORDS if getattr(rule, name, None) is not None]
    return f"a number of {len(str(abs(value)))} digits is out of range" + (f" ({', '.join(bounds)})" if bounds else "")


def first_field(exc: RequestValidationError) -> str | None:
    """The field the first validation error is about (dotted for a nested one), None for the body as a whole."""
    for err in exc.errors()[:1]:
        where = [str(p) for p in err.get("loc", ()) if p != "body" and not isinstance(p, int)]
        return ".".join(where) or None
    return None


def describe(exc: RequestValidationError, model: type[BaseModel] | None = None,
             content_type: str | None = "application/json") -> str:
    """One message for the ways a body of `model` sent as `content_type` failed validation (the first MAX_ERRORS,
    then a count); an unknown key's message ends with the keys allowed where it is, when the model is known."""
    parts = []
    allowed: dict[str, tuple[str, ...]] = {}  # where an unknown key is -> the keys allowed there
    errors = exc.errors()
    for err in errors[:MAX_ERRORS]:
        kind, keys = err.get("type"), tuple(p for p in err.get("loc", ()) if p != "body")
        if not keys and kind == "missing":
            parts.append("the body is empty: send the song request as a JSON object")
            continue
        if not keys and kind in OBJECT_EXPECTED and not json_media_type(content_type):  # FastAPI did not parse it
            parts.append("send the body as JSON with Content-Type: application/json; this request's is "
                         + (f"{content_type!r:.80}" if content_type else "missing"))
            continue
        if not keys and kind in OBJECT_EXPECTED:
            parts.append("the body must be a JSON object ({...}, not a list, string, number or null), sent with "
                         "Content-Type: application/json")
            continue
        if err.get("type") == "json_invalid":  # loc: ("body", offset of the error)
            why = err.get("ctx", {}).get("error", "malformed")
            where = "" if why.endswith(" at") else " at"  # json's "Invalid control character at" names no place
            parts.append(f"the body is not valid JSON: {why}{where} character {err['loc'][-1]}")
            continue
        where = ".".join(f"{p!s:.80}" for p in err.get("loc", ()) if p != "body")  # a key may be huge
        message = err.get("msg", "invalid")
        if kind == "value_error":  # our own checks' words (naming their field), not pydantic's prefix
            message = str(err.get("ctx", {}).get("error", message))
        elif kind in OBJECT_EXPECTED:
            message = "must be a JSON object"
        elif kind == "float_type" and type(err.get("input")) is int:
            message = _past_float(model, keys, err["input"])
        elif kind == "extra_forbidden":
            message, parent = "unknown key", _model_at(model, keys[:-1])
            if parent is not None:
                allowed[".".join(map(str, keys[:-1]))] = accepted_fields(parent)
        elif not where:
            where = "body"
        parts.append(f"{where}: {message}" if where else message)
    if len(errors) > MAX_ERRORS:
        parts.append(f"and {len(errors) - MAX_ERRORS} more")
    parts += [f"the keys allowed{f' in {at}' if at else ''}: {', '.join(names)}" for at, names in allowed.items()]
    return "; ".join(parts) or "invalid request"
