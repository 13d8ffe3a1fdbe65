"""What the ``code`` verifier's sandboxed child keeps out of the answer's reach after it ran:
the values it sends back, plain values only, tagged where JSON has no type of its own
(``_encoder``) and written as JSON text by primitives taken before the answer runs
(``_json_writer``); the standard library the tests call, put back as it was
(``_library_keeper``); and a stdin/stdout program's run on one case (``_program_runner``).
Part of the child's program: grpolab.rewards.sandbox sends this file's text ahead of
sandbox_child.py's; never imported."""


def _encoder():
    """``encode(value)``: the value as plain JSON, tagged where JSON has no type of its own. A
    subclass of a plain type (Counter, defaultdict, namedtuple, IntEnum) is sent as its base
    type's value, read with the base type's own methods (its ``__eq__`` or ``__iter__`` never
    runs: the comparison is made in the trainer, on the plain value); anything else is
    refused. Its recursion and everything it uses are its own (a closure taken before the
    answer runs: a module-level name the answer could replace would answer for nested values)."""
    type_, str_, int_, float_, bool_, list_, dict_, bytes_, complex_, issub = (
        type, str, int, float, bool, list, dict, bytes, complex, issubclass)
    items, hex_, value_error = dict.items, bytes.hex, ValueError
    series = ((list_, "", list.__iter__), (tuple, "t", tuple.__iter__),
              (set, "s", set.__iter__), (frozenset, "f", frozenset.__iter__))
    scalars = ((str_, str.__str__), (int_, int.__int__), (float_, float.__float__))

    def encode(value, depth=0):
        t = type_(value)
        if value is None or t is bool_ or t is int_ or t is str_ or t is float_:
            return value
        if depth > 40:
            raise value_error("too deep")
        for base, tag, each in series:
            if t is base or issub(t, base):
                out = [encode(v, depth + 1) for v in each(value)]
                return {tag: out} if tag else out
        if t is dict_ or issub(t, dict_):
            return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in items(value)]}
        if issub(t, bytes_):
            return {"b": hex_(value)}
        for base, plain in scalars:
            if issub(t, base):
                return plain(value)
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


def _library_keeper(clean_builtins, library):
    """``restore``, which puts the standard library back as it is now, before the answer runs
    (a test's own ``re.split(...)`` runs after the answer, which could have patched it):
    ``restore(None, None)`` every module; ``restore(names, env)`` those a test step names (its
    ``co_names``, or a module ``env`` binds one to), with the classes they define; modules
    imported since are dropped (imported afresh) and ``env`` gets the builtins as they were. A
    function's code rewritten in place is the audit hook's to refuse: ``library`` gets their
    ids."""
    import sys

    modules, dict_, type_, len_, any_, id_, set_ = sys.modules, dict, type, len, any, id, set
    zip_, items_ = zip, dict.items
    setattr_, set_attr, del_attr, missing = (object.__setattr__, type.__setattr__,
                                             type.__delattr__, object())
    kept = {}  # name: (module, its type, its dict, a copy, [(class, a copy of its dict)],
    #                   [(a module-level dict or list, a copy)])
    for name, m in list(modules.items()):
        if type_(d := getattr(m, "__dict__", None)) is dict_:
            kept[name] = (m, type_(m), d, dict_(d), [(c, dict_(c.__dict__)) for c in d.values()
                          if isinstance(c, type) and getattr(c, "__module__", None) == name],
                          [(box, type_(box)(box)) for box in d.values()  # re's cache, meta_path
                           if type_(box) in (dict_, list) and box is not modules])
    by_id = {id_(v[0]): name.split(".")[0] for name, v in kept.items()}
    function, wrappers = type(_library_keeper), (staticmethod, classmethod)
    values = (str, int, float, bool, list, tuple, dict, set, frozenset, bytes, complex,
              type(None))  # (a test's own `array = [1, 2]` stays)
    for _, _, _, snap, classes, _ in kept.values():
        for v in [*snap.values(), *(v for _, attrs in classes for v in attrs.values())]:
            v = v.__func__ if type_(v) in wrappers else v
            if type_(v) is function:
                library.add(id_(v))

    def restore(names, env, src=""):
        for name in [n for n in modules if n not in kept]:
            del modules[name]
        roots = None if names is None else set_(names) | {
            by_id[id_(env[n])] for n in names if n in env and id_(env[n]) in by_id}
        for name, (m, cls, d, snap, classes, boxes) in kept.items():
            if roots is not None and name.split(".")[0] not in roots:
                continue
            modules[name] = m
            if type_(m) is not cls:
                setattr_(m, "__class__", cls)
            if len_(d) != len_(snap) or any_(d.get(k, missing) is not v for k, v in snap.items()):
                d.clear()
                d.update(snap)
            for box, was in boxes:
                same = len_(box) == len_(was) and not any_(
                    box.get(k, missing) is not v for k, v in items_(was)) if type_(box) is dict_ \
                    else len_(box) == len_(was) and not any_(a is not b for a, b in zip_(box, was))
                if not same:
                    box.clear()
                    if type_(box) is dict_:
                        box.update(was)
                    else:
                        box.extend(was)
            for c, attrs in classes:
                for k in [k for k in c.__dict__ if k not in attrs]:
                    del_attr(c, k)
                for k, v in attrs.items():
                    if c.__dict__.get(k, missing) is not v:
                        set_attr(c, k, v)
        if env is not None:
            env["__builtins__"] = dict_(clean_builtins)
            for n in names:  # `math.floor(x)` in a test means the module, not an object the
                if n in kept and n in env and n + "." in src and type_(env[n]) not in values:
                    env[n] = kept[n][0]  # answer named so (its own `def copy(x)` stays)
    return restore


def _program_runner(sys, exec_, clean, base):
    """``run(code, stdin)``: the output of the compiled program run on ``stdin``: fd 0 and
    ``sys.stdin`` read the input (``input()``, ``open(0)``, ``sys.stdin.buffer``), fd 1 and
    ``sys.stdout`` write to a file of the scratch folder, read back after (print, writes,
    ``os.write(1, ...)``); exit(0) ends it as a program ends."""
    import io
    import posix

    open_, dup2, close, read, write = io.open, posix.dup2, posix.close, posix.read, posix.write
    fopen, exit_, too_much, len_ = posix.open, SystemExit, ValueError, len
    new, ro, join, decode = (posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC, posix.O_RDONLY,
                             b"".join, bytes.decode)
    where = posix.getcwd() + "/std"  # the scratch folder: the answer may chdir

    def leave(code=None):  # exit() and quit(), which python -S leaves out of builtins
        raise exit_(code)

    def run(code, stdin):
        fd = fopen(where + "in.txt", new, 0o600)
        write(fd, stdin.encode())
        close(fd)
        for name, mode, target in (("in.txt", ro, 0), ("out.txt", new, 1)):
            name = where + name
            fd = fopen(name, mode, 0o600)
            if fd != target:  # (the answer's open(0) closed fd 0 when collected: fd is 0)
                dup2(fd, target)
                close(fd)
        sys.stdin, out = open_(0, "r", closefd=False), open_(1, "w", closefd=False)
        sys.stdout = out
        try:
            exec_(code, {"__name__": "__main__", "__builtins__": {**clean, "exit": leave,
                                                                  "quit": leave}})
        except exit_ as e:
            if e.code is not None and e.code != 0:
                raise
        finally:
            try:
                out.flush()
            except base:
                pass
        fd, chunks = fopen(where + "out.txt", ro), []
        while chunk := read(fd, 1 << 20):
            chunks.append(chunk)
            if len_(chunks) > 1:
                raise too_much("over 1 MB of output")
        close(fd)
        return decode(join(chunks), "utf-8", "replace")
    return run
