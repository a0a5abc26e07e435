"""JSON schemas of our own making for structured output's tests and benchmark (issue 33).

Each is (what to ask for, schema), covering the JSON Schema features users send: every type,
required and optional properties, closed objects, enums and consts, nested objects and arrays of
objects, lengths and counts, numeric bounds, patterns, formats, anyOf / oneOf / allOf, $defs
with $ref, tuples (prefixItems), nullable fields and free-form objects.
"""
from __future__ import annotations

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 130}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 80},
                                                 "author": {"type": "string", "maxLength": 60},
                                                 "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                                                 "isbn": {"type": "string", "pattern": "^[0-9]{13}$"}},
                "required": ["title", "author", "year"], "additionalProperties": False}),
    ("the weather today", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow", "fog"]}},
        "required": ["city", "temperature_c", "sky"], "additionalProperties": False}),
    ("three prime numbers", {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 1000},
                             "minItems": 3, "maxItems": 3}),
    ("a yes-or-no answer to: is water wet?", {"type": "object", "properties": {"answer": {"type": "boolean"},
                                                                               "confidence": {"type": "number",
                                                                                              "minimum": 0,
                                                                                              "maximum": 1}},
                                            "required": ["answer", "confidence"], "additionalProperties": False}),
    ("a shopping list", {"type": "object", "properties": {"items": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["name", "quantity"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("a point on a plane", {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "number"},
                                                             "y": {"type": "number"}},
                            "required": ["kind", "x", "y"], "additionalProperties": False}),
    ("a calendar event", {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                                           "date": {"type": "string", "format": "date"},
                                                           "attendees": {"type": "array", "maxItems": 5,
                                                                         "items": {"type": "string", "maxLength": 30}}},
                          "required": ["title", "date"], "additionalProperties": False}),
    ("a user account", {"type": "object", "properties": {"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                                                         "email": {"type": "string", "format": "email", "maxLength": 60},
                                                         "admin": {"type": "boolean"}},
                        "required": ["username", "email", "admin"], "additionalProperties": False}),
    ("a color", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "rgb": {"type": "array", "prefixItems": [
                                                      {"type": "integer", "minimum": 0, "maximum": 255},
                                                      {"type": "integer", "minimum": 0, "maximum": 255},
                                                      {"type": "integer", "minimum": 0, "maximum": 255}],
                                                      "items": False, "minItems": 3}},
                 "required": ["name", "rgb"], "additionalProperties": False}),
    ("a shape: a circle or a square", {"oneOf": [
        {"type": "object", "properties": {"shape": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 100}},
         "required": ["shape", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"shape": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 100}},
         "required": ["shape", "side"], "additionalProperties": False}]}),
    ("a value that is a word or null", {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,12}$"}, {"type": "null"}]}),
    ("a company with its address", {"type": "object", "$defs": {"address": {
        "type": "object", "properties": {"street": {"type": "string", "maxLength": 50},
                                         "city": {"type": "string", "maxLength": 30},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}},
        "properties": {"name": {"type": "string", "maxLength": 40}, "address": {"$ref": "#/$defs/address"}},
        "required": ["name", "address"], "additionalProperties": False}),
    ("a product with an optional discount", {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": {"type": "number", "minimum": 0},
        "discount": {"type": ["number", "null"], "minimum": 0, "maximum": 1}},
        "required": ["sku", "price"], "additionalProperties": False}),
    ("a list of up to four tags", {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,10}$"},
                                   "maxItems": 4}),
    ("an HTTP response", {"type": "object", "properties": {"status": {"enum": [200, 201, 400, 404, 500]},
                                                          "headers": {"type": "object",
                                                                      "additionalProperties": {"type": "string",
                                                                                               "maxLength": 40},
                                                                      "maxProperties": 3},
                                                          "body": {"type": "string", "maxLength": 100}},
                          "required": ["status", "body"], "additionalProperties": False}),
    ("a matrix of two rows of two numbers", {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number"}}}),
    ("a sentiment label", {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                                            "score": {"type": "number", "minimum": -1, "maximum": 1}},
                           "required": ["label"], "additionalProperties": False}),
    ("a recipe", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 50},
        "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 80}}},
        "required": ["name", "servings", "steps"], "additionalProperties": False}),
    ("a version", {"type": "string", "pattern": "^v[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,3}$"}),
    ("a bounded count", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("a tagged record", {"allOf": [
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 100000}}, "required": ["id"]},
        {"type": "object", "properties": {"id": True, "tag": {"enum": ["new", "old"]}}, "required": ["tag"],
         "additionalProperties": False}]}),
    ("a temperature reading in kelvin", {"type": "object", "properties": {
        "kelvin": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}, "sensor": {"type": "string", "maxLength": 20}},
        "required": ["kelvin", "sensor"], "additionalProperties": False}),
    ("a free-form settings object", {"type": "object", "maxProperties": 4,
                                     "additionalProperties": {"type": ["string", "number", "boolean"],
                                                              "maxLength": 30}}),
]


def prompt(what: str, schema: dict) -> str:
    """The user message asking for `what` as JSON matching `schema`."""
    import json

    return f"Reply with JSON only, matching this JSON schema: {json.dumps(schema)}\nGive {what}."
