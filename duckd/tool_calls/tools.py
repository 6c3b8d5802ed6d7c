"""The request's tools: an OpenAI tools list checked and normalized (check_tools), a strict
schema closed to properties it does not name (closed_schema), and ToolFormatError, which names
the bad field of a tools list, tool choice or history."""
from __future__ import annotations

import copy
import re

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for a function name


class ToolFormatError(ValueError):
    """A bad tools list, tool choice or history: the message names the field."""


def check_tools(tools) -> list[dict]:
    """An OpenAI tools list, checked and normalized: [{"type": "function", "function": {"name",
    "description"?, "parameters", "strict"?}}], parameters {"type": "object", "properties": {}}
    when absent. ToolFormatError names the bad field."""
    if not isinstance(tools, list):
        raise ToolFormatError('tools: expected a list of {"type": "function", "function": {...}} objects')
    out, seen = [], set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolFormatError(f"{at}: expected an object")
        if tool.get("type", "function") != "function":
            raise ToolFormatError(f"{at}.type: only 'function' tools are supported, not {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolFormatError(f"{at}.function: expected an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolFormatError(f"{at}.function.name: {name!r} is not a function name "
                                  f"(1 to 64 of a-z, A-Z, 0-9, _ and -)")
        if name in seen:
            raise ToolFormatError(f"{at}.function.name: {name!r} is named twice")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolFormatError(f"{at}.function.description: expected a string")
        params = fn.get("parameters")
        if params is None or params == {}:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolFormatError(f"{at}.function.parameters: expected a JSON schema object")
        if params.get("type", "object") != "object":
            raise ToolFormatError(f"{at}.function.parameters.type: the arguments must be an object, "
                                  f"not {params.get('type')!r}")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ToolFormatError(f"{at}.function.parameters.properties: expected an object of schemas")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolFormatError(f"{at}.function.parameters.required: expected a list of names")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolFormatError(f"{at}.function.strict: expected true or false")
        norm = {"name": name}
        if desc is not None:
            norm["description"] = desc
        norm["parameters"] = closed_schema(params) if strict else copy.deepcopy(params)
        if strict is not None:
            norm["strict"] = strict
        out.append({"type": "function", "function": norm})
    return out


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")   # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def closed_schema(schema):
    """A copy of a JSON schema whose objects allow no property beyond those they name, where they
    do not say otherwise (additionalProperties absent): OpenAI's strict mode, where such a schema
    must say so itself. A schema given with strict true is read this way."""
    if not isinstance(schema, dict):
        return copy.deepcopy(schema)
    out = copy.deepcopy(schema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed_schema(sub) for sub in schema[key]]
    for key in SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            out[key] = closed_schema(schema[key])
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
