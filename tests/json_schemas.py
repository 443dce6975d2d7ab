"""JSON schemas for the structured-output tests: nested objects, arrays, enums, bounded numbers,
required and optional fields. Strings and arrays are bounded (maxLength, maxItems) so that a random
model, which the mask keeps valid but does not steer towards an end, finishes in a few dozen tokens."""

S = {"type": "string", "maxLength": 6}
NAME = {"type": "string", "minLength": 1, "maxLength": 8}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "s": S}, "required": ["n", "s"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME, "admin": {"type": "boolean"}}, "required": ["name", "admin"], "additionalProperties": False},
        "level": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["user", "level"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9}},
                                "required": ["id"], "additionalProperties": False}, "maxItems": 2},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"enum": [200, 404, 500]}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 2,
                                                                                 "maximum": 4}},
     "required": ["kind"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": [1, 2, 3]}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"cat": {"type": "boolean"}}, "required": ["cat"],
                "additionalProperties": False},
               {"type": "object", "properties": {"dog": {"type": "integer", "minimum": 0, "maximum": 5}},
                "required": ["dog"], "additionalProperties": False}]},
    {"type": "object", "properties": {"first": NAME, "last": NAME, "middle": NAME},
     "required": ["first", "last"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
     "required": ["ratio"], "additionalProperties": False},
    {"type": "object", "properties": {"lang": {"enum": ["en", "fr", "de"]}, "words": {
        "type": "array", "items": S, "maxItems": 2}}, "required": ["lang", "words"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "object", "properties": {
        "h": {"type": "integer", "minimum": 0, "maximum": 23}, "m": {"type": "integer", "minimum": 0, "maximum": 59}},
        "required": ["h", "m"], "additionalProperties": False}, "ok": {"type": "boolean"}},
     "required": ["when", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1000, "maximum": 9999},
                                      "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["id", "flags"], "additionalProperties": False},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["note"], "additionalProperties": False},
]
