"""The values the ``code`` verifier's sandboxed child sends back: plain values only, tagged where
JSON has no type of its own (``_encoder``), written as JSON text by primitives taken before the
answer runs (``_json_writer``). Part of the child's program: grpolab.rewards.sandbox sends this
file's text ahead of sandbox_child.py's; never imported."""


def _encoder():
    """``encode(value)``: the value as plain JSON, tagged where JSON has no type of its own;
    anything but the builtin types themselves (no subclasses: they could carry an __eq__) is
    refused. Its recursion and everything it uses are its own (a closure taken before the
    answer runs: a module-level name the answer could replace would answer for nested values)."""
    type_, str_, int_, float_, bool_, list_, dict_, bytes_, complex_ = (
        type, str, int, float, bool, list, dict, bytes, complex)
    tags, items, hex_, value_error = ({tuple: "t", set: "s", frozenset: "f"}, dict.items,
                                      bytes.hex, ValueError)

    def encode(value, depth=0):
        t = type_(value)
        if value is None or t is bool_ or t is int_ or t is str_ or t is float_:
            return value
        if depth > 40:
            raise value_error("too deep")
        if t is list_:
            return [encode(v, depth + 1) for v in value]
        if t in tags:
            return {tags[t]: [encode(v, depth + 1) for v in value]}
        if t is dict_:
            return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in items(value)]}
        if t is bytes_:
            return {"b": hex_(value)}
        if t is complex_:
            return {"c": [value.real, value.imag]}
        raise value_error("not a plain value")
    return encode


def _json_writer():
    """``_encoder``'s output (exact None, bool, int, float, str, list, and one-key dicts) as JSON
    text, as ``json.dumps`` writes it, with every function it uses taken now: a C function or a
    builtin type's own method cannot be patched by the answer later."""
    import _json

    quote, join, int_repr, float_repr = (_json.encode_basestring_ascii, str.join, int.__repr__,
                                         float.__repr__)
    type_, bool_, int_, float_, str_, list_, dict_, items = (type, bool, int, float, str, list,
                                                             dict, dict.items)
    special = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}

    def text(x):
        t = type_(x)
        if x is None:
            return "null"
        if t is bool_:
            return "true" if x else "false"
        if t is int_:
            return int_repr(x)
        if t is float_:
            r = float_repr(x)
            return special.get(r, r)
        if t is str_:
            return quote(x)
        if t is list_:
            return "[" + join(", ", [text(v) for v in x]) + "]"
        if t is dict_:
            return "{" + join(", ", [quote(k) + ": " + text(v) for k, v in items(x)]) + "}"
        raise ValueError("not a plain value")
    return text
