"""The program the ``code`` verifier's sandboxed interpreter runs (``python -I -S -c <this>``).

It is never imported by grpolab: grpolab.rewards.sandbox reads this file's text and hands it to
a fresh interpreter, which reads its job from stdin, fences itself in, runs the answer, then
evaluates the tests' expressions and writes back their values as plain JSON, one
"<nonce> v <test> <step> <json>" line each. It never sees the values the tests expect and
never decides whether a test passed: the parent does that, so nothing the answer does to this
process (its frames, builtins, ``__eq__``) can turn a wrong value into a pass.

The fence, before any of the answer's code runs: new mount, network and IPC namespaces (as
root, or inside a new user namespace where the kernel allows it) whose root is a small
read-only tmpfs holding read-only binds of the system libraries and the standard library,
/dev/null and /dev/urandom, a fresh /proc that hides other users' processes, and the scratch
folder as a tmpfs of ``disk_mb`` (the disk quota); then the ``nobody`` user (as root), resource
limits and a Python audit hook. Where no mount namespace can be had, the audit hook is the
boundary: paths resolved (links followed), no ``..``, no links made, no directory descriptors,
no ``dir_fd``, and a cap on files created.
"""

import json
import os
import sys

PRELOAD = ("math", "cmath", "random", "re", "string", "collections", "collections.abc",
           "itertools", "functools", "operator", "heapq", "bisect", "array", "copy",
           "statistics", "fractions", "decimal", "numbers", "typing", "dataclasses", "enum",
           "datetime", "_strptime", "time", "textwrap", "unicodedata", "hashlib", "struct", "io",
           "abc", "contextlib", "types", "weakref", "keyword", "base64", "binascii", "zlib",
           "calendar", "difflib", "pprint", "queue", "threading", "traceback", "secrets",
           "inspect", "ast", "tokenize", "pathlib", "json", "tempfile", "shutil")
NEWNS, NEWNET, NEWIPC, NEWUSER = 0x00020000, 0x40000000, 0x08000000, 0x10000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "i686": 217, "armv7l": 218,
              "ppc64le": 203, "s390x": 217}
MAX_ITEMS = 100_000  # an iterator the tests consume is sent as a list of at most this many
MAX_NEW_FILES = 64  # the audit hook's disk quota: this many files of disk_mb / 64 each


class _Libc:
    def __init__(self):
        import ctypes
        self.ct = ctypes
        self.c = ctypes.CDLL(None, use_errno=True)
        p = ctypes.c_char_p
        self.c.mount.argtypes = [p, p, p, ctypes.c_ulong, p]

    def check(self, rc, what):
        if rc != 0:
            err = self.ct.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(self, src, dst, fstype, flags, data=None):
        enc = [None if s is None else os.fsencode(s) for s in (src, dst, fstype, data)]
        self.check(self.c.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {dst}")


def _namespaces(libc, root, mount):
    """Enter new namespaces: 'mount' (mount, network, IPC), 'net' (network only) or ''."""
    for flags, kind in ((NEWNS | NEWNET | NEWIPC, "mount"), (NEWNET, "net"))[not mount:]:
        if root:
            if libc.c.unshare(flags) == 0:
                return kind
            continue
        uid, gid = os.getuid(), os.getgid()
        if libc.c.unshare(NEWUSER | flags) != 0:
            continue
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            try:
                with open(path, "w") as f:
                    f.write(text)
            except OSError:
                pass
        return kind
    return ""


def _new_root(libc, scratch, disk_mb, root, nobody):
    """Make the new root (see the module's docstring) and pivot into it; the scratch folder
    keeps its path. On failure, undo and raise."""
    new = scratch
    libc.mount(None, "/", None, REC | PRIVATE)
    libc.mount("tmpfs", new, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
    try:
        stdlib = os.path.realpath(os.path.dirname(os.__file__))
        keep = ["/usr", "/lib", "/lib64", "/lib32", "/bin"]
        keep += [stdlib] if not stdlib.startswith("/usr/") else []
        for path in keep:
            target = new + path
            if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.symlink(os.readlink(path), target)
            elif os.path.isdir(path):
                os.makedirs(target, exist_ok=True)
                libc.mount(path, target, None, BIND | REC)
                # keep the source's own flags: a user namespace may not drop locked ones
                ro = RDONLY | NOSUID | NODEV | (os.statvfs(path).f_flag & NOEXEC)
                libc.mount(None, target, None, REMOUNT | BIND | ro)
        os.makedirs(new + "/dev")
        for dev in ("/dev/null", "/dev/urandom", "/dev/random"):
            open(new + dev, "w").close()
            libc.mount(dev, new + dev, None, BIND)
        os.makedirs(new + "/proc")
        try:  # hidepid: other users' processes (the trainer's) are invisible
            libc.mount("proc", new + "/proc", "proc", NOSUID | NODEV | NOEXEC, "hidepid=2")
        except OSError:
            pass
        os.makedirs(new + scratch)
        owner = f",uid={nobody},gid={nobody}" if root else ""
        libc.mount("tmpfs", new + scratch, "tmpfs", NOSUID | NODEV,
                   f"size={disk_mb}m,nr_inodes=4096,mode=700{owner}")
        os.chdir(new)
        nr = PIVOT_ROOT.get(os.uname().machine)
        if nr is not None:  # pivot_root(".", ".") then detach the old root stacked on it
            libc.check(libc.c.syscall(nr, b".", b"."), "pivot_root")
            libc.check(libc.c.umount2(b".", 2), "umount old root")
        else:
            os.chroot(".")
        os.chdir("/")
        libc.mount(None, "/", None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
    except BaseException:
        os.chdir("/")
        libc.c.umount2(os.fsencode(new), 2)
        raise


CODE = ("__code__", "gi_code", "cr_code", "ag_code")  # immutable, read on import by logging


def _guard(home, reads, lim, mounted, library):
    """The audit hook. Everything it uses is captured here: the answer shares the
    interpreter and could replace builtins or module attributes later."""
    import posix
    import stat as stat_mod
    getcwd, lstat, readlink, stat_ = posix.getcwd, posix.lstat, posix.readlink, posix.stat
    isinstance_, type_, str_, bytes_, int_, len_, any_, id_, bool_ = (
        isinstance, type, str, bytes, int, len, any, id, bool)
    perm, imp, deep, fspath, os_error = PermissionError, ImportError, ValueError, os.fspath, OSError
    code_reads, max_new = frozenset(CODE), MAX_NEW_FILES  # (not the module's: its own to rebind)
    import pathlib
    plain = (str, bytes, pathlib.PosixPath, pathlib.PurePosixPath)
    S_ISLNK, S_ISDIR = stat_mod.S_ISLNK, stat_mod.S_ISDIR
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    NOT_FILE = os.O_DIRECTORY | getattr(os, "O_PATH", 0)
    created = [0]

    def resolve(path):
        if type_(path) not in plain:
            raise perm("sandbox: only str, bytes and pathlib paths")
        path = fspath(path)
        if isinstance_(path, bytes_):
            path = path.decode("utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        todo, parts, hops = path.split("/")[::-1], [], 0
        while todo:
            part = todo.pop()
            if part == "..":  # with no directory descriptors, ".." is the one way to wander
                raise perm("sandbox: no '..' in paths")
            if not part or part == ".":
                continue
            here = "/" + "/".join([*parts, part])
            try:
                is_link = S_ISLNK(lstat(here).st_mode)
            except os_error:
                is_link = False
            if is_link:
                hops += 1
                if hops > 40:
                    raise perm("sandbox: too many links")
                target = readlink(here)
                todo.extend(target.split("/")[::-1])
                if target.startswith("/"):
                    parts = []
                else:  # a relative link's ".." is resolved here, not refused
                    while todo and todo[-1] in ("..", ".", ""):
                        if todo.pop() == ".." and parts:
                            parts.pop()
                continue
            parts.append(part)
        return "/" + "/".join(parts)

    def under(p, roots):
        return any_(p == r or p.startswith(r + "/") for r in roots)

    def is_dir(p):
        try:
            return S_ISDIR(stat_(p).st_mode)
        except os_error:
            return False

    def inside(args, event):
        for a in args:
            if a is not None and not isinstance_(a, int_) and not under(resolve(a), (home,)):
                raise perm(f"sandbox: {event} outside its folder")

    def new_file(p):
        try:
            lstat(p)
        except os_error:
            created[0] += 1
            if not mounted and created[0] > max_new:
                raise perm("sandbox: too many files (disk quota)") from None

    denied = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
              "os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "os.startfile",
              "signal.pthread_kill", "gc.get_", "pty.", "sys._current_",
              "sys.settrace", "sys.setprofile", "sys.remote_exec", "sys.monitoring",
              "os.link", "os.symlink", "os.chroot", "sys.addaudithook", "resource.",
              "os.fwalk", "cpython.PyInterpreterState", "mmap.", "_posixsubprocess")
    no_import = {"ctypes", "_ctypes", "_posixsubprocess", "subprocess", "socket", "_socket",
                 "signal", "_signal",  # (a fresh copy would bring back what was taken away)
                 "ssl", "_ssl", "multiprocessing", "_multiprocessing", "pty", "fcntl", "mmap",
                 "_testcapi", "_testinternalcapi", "_xxsubinterpreters"}
    dir_fds = {"os.remove": (1,), "os.rmdir": (1,), "shutil.rmtree": (1,), "os.mkdir": (2,), "os.chmod": (2,),
               "os.chown": (3,), "os.utime": (3,), "os.rename": (2, 3)}
    changes = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
               "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.")
    looks = ("os.listdir", "os.scandir", "os.chdir", "glob.glob", "os.getxattr", "os.listxattr")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance_(path, int_):
                return  # an fd it already holds (pipes, files it was allowed to open)
            writing = bool_(flags & W) if mode is None else any_(c in mode for c in "wax+")
            p = resolve(path)
            if flags & NOT_FILE or is_dir(p):  # a directory fd would anchor dir_fd= paths
                raise perm(f"sandbox: no opening directory {p}")
            if under(p, (home,)):
                if writing:
                    new_file(p)
                return
            if writing:
                raise perm(f"sandbox: no writing outside its folder ({p})")
            if not under(p, reads):
                raise perm(f"sandbox: no reading {p}")
        elif event == "sys._getframe":  # ValueError: namedtuple, typing and enum fall back on it
            raise deep("sandbox: no frames")
        elif event == "object.__getattr__" and args[1] not in code_reads:  # a frame; a function's
            raise deep(f"sandbox: no reading {args[1]}")  # defaults (a library's mutable ones):
        #   ValueError: inspect's "no signature", on which dataclass falls back
        elif event.startswith(denied):
            raise perm(f"sandbox: {event} is not allowed")
        elif event == "object.__setattr__" and id_(args[0]) in library:  # its __code__ ...
            raise perm(f"sandbox: no setting {args[1]} of the standard library's functions")
        elif event == "import":
            if args[0].split(".")[0] in no_import:
                raise imp(f"sandbox: module {args[0]} is not available")
        elif event.startswith(changes):
            for i in dir_fds.get(event, ()):
                if len_(args) > i and args[i] not in (None, -1):
                    raise perm(f"sandbox: no dir_fd ({event})")
            if event == "os.mkdir":
                new_file(resolve(args[0]))
            if event.startswith("shutil."):
                inside([a for a in args if type_(a) in plain], event)
            else:
                inside(args[:2] if event == "os.rename" else args[:1], event)
        elif event.startswith(looks):
            if event in ("os.listdir", "os.scandir", "os.chdir") and isinstance_(args[0], int_):
                raise perm(f"sandbox: no directory descriptors ({event})")
            if event == "glob.glob/2" and (args[2] is not None or args[3] is not None):
                raise perm("sandbox: glob with root_dir or dir_fd")
            p = fspath(args[0]) if args[0] is not None else "."
            if event.startswith("glob."):  # the folder part before any wildcard
                for ch in "*?[":
                    p = p.split(ch if isinstance_(p, str_) else ch.encode())[0]
                p = p or "."
            if not under(resolve(p), reads if event != "os.chdir" else (home,)):
                raise perm(f"sandbox: {event} outside its folder")

    return hook


def _main(job):
    import builtins
    import gc
    import posix
    import resource
    for name in PRELOAD:
        try:  # as `nobody` without a mount namespace, the standard library may be unreadable
            __import__(name)
        except Exception:  # noqa: BLE001, S110 - a module this build lacks
            pass
    nonce, code, program, lim = job["nonce"], job["code"], job["program"], job["limits"]
    stdio = job["stdio"]
    write = os.fdopen(job["fd"], "w", buffering=1).write
    scratch, nobody = job["scratch"], job["nobody"]
    root, mode, libc = posix.geteuid() == 0, "", None
    if sys.platform.startswith("linux"):
        try:
            libc = _Libc()
            mode = _namespaces(libc, root, job["mount"])
            if mode == "mount":
                try:
                    _new_root(libc, scratch, lim["disk_mb"], root, nobody)
                except OSError:
                    mode = "net"
            libc.c.prctl(38, 1, 0, 0, 0)  # no_new_privs
        except Exception:  # noqa: BLE001, S110 - no ctypes or no libc: the hook alone
            pass
    if root:
        posix.setgroups([])
        posix.setgid(nobody)
        posix.setuid(nobody)
    if libc is not None:  # die with the trainer: no orphan outlives a killed run
        libc.c.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG(SIGKILL), set after setuid cleared it
        del libc
    for m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[m]
    if posix.getppid() != job["ppid"]:  # the trainer died before that
        return
    posix.chdir(scratch)
    mounted = mode == "mount"
    file_mb = lim["file_mb"] if mounted else min(lim["file_mb"], max(1, lim["disk_mb"] // 64))
    for what, soft, hard in ((resource.RLIMIT_CPU, lim["cpu_seconds"], lim["cpu_seconds"] + 1),
                             (resource.RLIMIT_AS, lim["memory_mb"] << 20, lim["memory_mb"] << 20),
                             (resource.RLIMIT_FSIZE, file_mb << 20, file_mb << 20),
                             (resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"]),
                             (resource.RLIMIT_CORE, 0, 0),
                             (getattr(resource, "RLIMIT_NPROC", None), 0, 0)):
        if what is not None:
            try:
                resource.setrlimit(what, (soft, hard))
            except (ValueError, OSError):
                pass
    signals = ("signal", "setitimer", "alarm", "raise_signal", "set_wakeup_fd", "siginterrupt",
               "pidfd_send_signal")  # a handler is handed the frame it interrupts: the harness's
    for mod, names in ((os, ("mkfifo", "mknod", "pidfd_open")), (posix, ("mkfifo", "mknod")),
                       (sys.modules.get("signal"), signals), (sys.modules.get("_signal"), signals)):
        for name in names:  # no audit events for these: take them away
            if mod is not None and hasattr(mod, name):
                delattr(mod, name)
    library = set()  # ids of the standard library's functions (``_library_keeper``)
    if lim["python_guard"]:
        home = os.path.realpath(scratch)
        reads = (home, os.path.realpath(os.path.dirname(os.__file__)), "/dev/null",
                 "/dev/urandom", "/dev/random")
        sys.addaudithook(_guard(home, reads, lim, mounted, library))
    exec_, eval_, compile_, dict_, enumerate_, base, type_ = (
        exec, eval, compile, dict, enumerate, BaseException, type)
    plain = (type, str, int, float, bool, list, tuple, dict, set, frozenset, bytes, complex)
    issub, str_, mro = issubclass, str, type.__dict__["__mro__"].__get__
    errors, id_ = {}, id  # id of a builtin exception class: its names (IOError is OSError)
    for name, v in vars(builtins).items():  # (by identity: `c in a set` would ask c's metaclass)
        if isinstance(v, type) and issub(v, base):
            errors.setdefault(id_(v), []).append(name)
    # JSON written by primitives taken now: json.dumps would call library code the answer can
    # patch (its encoder instance) after it ran
    encode, dumps = _encoder(), _json_writer()  # noqa: F821 - sandbox_values.py, sent first
    list_, len_, overflow, too_big, max_items = list, len, OverflowError, ValueError, MAX_ITEMS

    def take(iterable):
        items = list_()  # then each item must be plain like any value
        for item in iterable:
            items.append(item)
            if len_(items) > max_items:  # an endless generator fails this test, not the run
                raise overflow("too many items")
        return items

    def say(text):
        try:
            write(nonce + " " + text + "\n")
        except base:
            pass
    clean = dict_(builtins.__dict__)
    ns = {"__name__": "__solution__", "__builtins__": dict_(clean)}
    restore = _library_keeper(dict_(clean), library)  # noqa: F821 - sandbox_values
    run_io = _program_runner(sys, exec_, clean, base)  # noqa: F821 - sandbox_values
    del job
    say("start " + (mode or "none"))
    try:
        solution = compile_(code, "<solution>", "exec")
        if not stdio:  # a program runs once per case, on its input
            exec_(solution, ns)
    except base as e:
        say("failed " + type_(e).__name__)
        return
    restore(None, None)
    collect, gc_on, gc_off = gc.collect, gc.enable, gc.disable
    for i, steps in enumerate_(program):
        env, k, bound = dict_(ns), 0, False
        for kind, src in steps:
            try:
                if kind == "stdio":
                    restore(None, None)  # sys's stdin and stdout too, then the case's own
                    value = run_io(solution, src)
                    say(f"v {i} {k} {dumps(encode(value))}")
                    break
                step = compile_(src, "<test>", "exec" if kind in ("exec", "raises") else "eval")
                if bound and kind != "exec" and not kind.startswith("bind:"):
                    collect()  # the answer's finalizers run now, not inside the library's call
                    restore(None, None)  # whatever the binds' answer code touched
                    gc_off()
                restore(step.co_names, env, src)  # the libraries the step calls, as they were
                if kind == "exec":
                    exec_(step, env)
                    continue
                if kind == "raises":  # what it raised, as the builtin exceptions it is one of
                    value = None
                    try:
                        exec_(step, env)
                    except base as e:
                        value = [[n for c in mro(type_(e)) for n in errors.get(id_(c), ())],
                                 str_(e)]
                else:
                    value = eval_(step, env)
                gc_on()
                if kind.startswith("keep:"):  # an operand the next step asks of, as it is
                    env[kind[5:]] = value
                elif kind[0] in "ib" and not issub(type_(value), plain):  # iter, bind: (a Counter
                    value = take(value)  # is a dict) a generator, map, range: only iterated there
                if kind.startswith("bind:"):  # a library call's argument: plain, or no call
                    encode(value)
                    env[kind[5:]], bound = value, True
                    continue
            except base as e:
                gc_on()
                say(f"e {i} {k} {type_(e).__name__}")
                break
            try:
                text = dumps(encode(value))
                if text.__len__() > 262_144:
                    raise too_big("too big")
            except base:
                text = "!"  # unserialisable: a failure, whatever it compares to
            say(f"v {i} {k} {text}")
            k += 1
    say("done")


if __name__ == "__main__":
    _main(json.loads(sys.stdin.buffer.read()))
