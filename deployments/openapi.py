"""The ingress's OpenAPI document: FastAPI's, plus what its handlers know and FastAPI
cannot see.

The POST handlers read their bodies themselves (`ingress.parse_body`, so every failure
is an OpenAI error JSON with the right status), which leaves FastAPI's document without
request bodies. `openapi_document` adds them from the same pydantic models the handlers
validate with, the bearer-key scheme every `/v1` route requires, and the OpenAI error
JSON of 4xx answers, so clients, code generators and fuzzers (schemathesis) see the
real contract at `/openapi.json`.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
"""OpenAI's error JSON (deployments/errors.py)."""


def openapi_document(app: FastAPI, bodies: Mapping[tuple[str, str], type[BaseModel]]) -> dict:
    """FastAPI's document for `app`, with the request body of each (path, method) in
    `bodies`, a bearer scheme on every /v1 route, and OpenAI error JSON for 4xx."""
    document = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    _, definitions = models_json_schema(
        [(model, "validation") for model in bodies.values()],
        ref_template="#/components/schemas/{model}",
    )
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(definitions.get("$defs", {}))
    components["schemas"]["OpenAIError"] = ERROR_SCHEMA
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    error = {
        "description": "OpenAI error JSON",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}},
    }
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            model = bodies.get((path, method))
            if model is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                        }
                    },
                }
            if path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
            operation.setdefault("responses", {})["4XX"] = error
    return document
