"""JSON schemas of different shapes (nested objects, arrays, enums, bounded numbers, optional fields, anyOf), each
with bounded strings and arrays so that a small model's answer finishes within a test's max_tokens."""

NAME = {"type": "string", "maxLength": 10}

SCHEMAS = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": {"type": "integer", "minimum": -100,
                                                                         "maximum": 100}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"name": NAME, "nickname": NAME}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"type": "integer", "minimum": 200,
                                                                            "maximum": 599}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["when"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"flags": {"type": "array", "maxItems": 4, "items": {"type": "boolean"}},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 4}},
     "required": ["flags", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": NAME, "admin": {
        "type": "boolean"}}, "required": ["name"], "additionalProperties": False}, "active": {"type": "boolean"}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["square"], "additionalProperties": False}]}}, "required": ["shape"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
]
