"""The tools an RL policy calls, run inside the episode's sandbox, and their OpenAI schemas (each family picks some).

    python(code)                 the code is python3's program (read from stdin); observation: its stdout
    ls(path=".")                 `ls -1p`: one entry a line, folders with a trailing "/"
    cat(path)                    the file's text
    grep(pattern, path, count?)  FIXED-STRING, case-sensitive match per line (no regex: a tiny policy copies the
                                 text it looks for verbatim). A file: its matching lines (count: their number). A
                                 folder: searched recursively in sorted path order, lines as "path:line" (count:
                                 "path:n" per file with n > 0; "0" when none). No match: "(no matches)".
    replace(path, old, new)      replaces the ONE occurrence of `old` in the file (absent or repeated: an error, so an
                                 edit never lands somewhere unintended); observation "ok"
    run_tests()                  runs test_mod.py (code-fix); observation: its output, pass or fail

Observations are the command's stdout with trailing newlines stripped ("(no output)" when empty), cut to
`max_chars` with a marker. Anything that goes wrong, whether the call was malformed, the tool is unknown, a path
leaves /workspace, the command failed (a non-zero exit; run_tests excepted: failing tests are its normal report) or
timed out, gives an observation starting with "error: " that names the problem; nothing here raises for what the
model wrote. Paths are relative to /workspace (absolute ones inside it are accepted); ".." and other absolute paths
are refused with a clear message, though the sandbox would contain them anyway. Text arguments travel on stdin, never
through a shell.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from openk3.sandbox import SandboxError

WORKSPACE = "/workspace"
TEST_FILE = "test_mod.py"  # what run_tests runs (the code-fix family's test file)
NO_OUTPUT, NO_MATCHES, CUT = "(no output)", "(no matches)", "[truncated]"
# -B: no __pycache__, whose mtime-keyed .pyc could survive a same-size edit made within the same second.
PYTHON = ("python3", "-B", "-s")


def _schema(name: str, description: str, properties: dict, required: Sequence[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}  # fmt: skip


_STR = {"type": "string"}
SCHEMAS = {
    "python": _schema("python", "Run Python code; returns stdout.", {"code": _STR}, ["code"]),
    "ls": _schema("ls", "List a folder.", {"path": _STR}, []),
    "cat": _schema("cat", "Read a file.", {"path": _STR}, ["path"]),
    "grep": _schema(
        "grep",
        "Lines containing a fixed string, in a file or folder; count=true counts them.",
        {"pattern": _STR, "path": _STR, "count": {"type": "boolean"}},
        ["pattern", "path"],
    ),
    "replace": _schema(
        "replace",
        "Replace the one occurrence of old with new in a file.",
        {"path": _STR, "old": _STR, "new": _STR},
        ["path", "old", "new"],
    ),
    "run_tests": _schema("run_tests", "Run the tests.", {}, []),
}
_TYPES = {"string": str, "boolean": bool}


def schemas(*names: str) -> list[dict]:
    """The OpenAI tool schemas of `names`, in that order."""
    return [SCHEMAS[n] for n in names]


class ToolError(Exception):
    """What was wrong with a call; its text becomes the observation after "error: "."""


@dataclass(frozen=True)
class ToolOutput:
    name: str  # the called tool's name as the model wrote it ("" when it gave none)
    text: str  # the observation
    error: bool  # the text starts with "error: "
    sandbox_s: float  # seconds spent in sandbox calls


def clip(text: str, limit: int, tail: bool = False) -> str:
    """`text` cut to `limit` characters, marker included; `tail` keeps the end (where a traceback says what broke)."""
    if len(text) <= limit:
        return text
    keep = limit - len(CUT) - 1
    if keep <= 0:
        return text[:limit]
    return CUT + "\n" + text[-keep:] if tail else text[:keep] + "\n" + CUT


def execute(sandbox, call: dict, available: Sequence[str], timeout: float, max_chars: int) -> ToolOutput:
    """Run one OpenAI-style tool call in `sandbox`; never raises for anything in `call`."""
    name = ""
    start = time.monotonic()
    try:
        name, args = parse_call(call, available)
        text = _run(sandbox, name, args, timeout)
    except ToolError as err:
        return ToolOutput(name, "error: " + clip(str(err), max_chars - len("error: "), tail=True), True,
                          time.monotonic() - start)  # fmt: skip
    return ToolOutput(name, clip(text or NO_OUTPUT, max_chars), False, time.monotonic() - start)


def parse_call(call: dict, available: Sequence[str]) -> tuple[str, dict]:
    """(tool name, arguments) of a call, checked against the tool's schema: ToolError says what is wrong."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError("malformed tool call: it needs a function with a name")
    name = fn["name"]
    if name not in available:
        raise ToolError(f"unknown tool {name!r}; available: {', '.join(available)}")
    raw = fn.get("arguments")
    if isinstance(raw, dict):
        args = raw
    else:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            raw = "{}"
        try:
            args = json.loads(raw)
        except (TypeError, ValueError):
            raise ToolError(f"the arguments of {name} are not valid JSON: {str(raw)[:60]!r}") from None
        if not isinstance(args, dict):
            raise ToolError(f"the arguments of {name} must be a JSON object, got {type(args).__name__}")
    params = SCHEMAS[name]["function"]["parameters"]
    props = params["properties"]
    for key, value in args.items():
        if key not in props:
            raise ToolError(f"{name} has no argument {key!r}; its arguments: {', '.join(props) or 'none'}")
        want = props[key]["type"]
        if not isinstance(value, _TYPES[want]):
            raise ToolError(f"argument {key!r} of {name} must be a {want}, got {type(value).__name__}")
        if isinstance(value, str) and not _utf8(value):  # JSON "\ud800" decodes to a lone surrogate
            raise ToolError(f"argument {key!r} of {name} is not valid Unicode text")
    missing = [k for k in params["required"] if k not in args]
    if missing:
        raise ToolError(f"{name} needs argument {missing[0]!r} ({props[missing[0]]['type']})")
    return name, args


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def workspace_path(path: str) -> str:
    """`path` relative to /workspace ("." for the workspace itself); ToolError for paths that leave it."""
    p = path.strip()
    if "\0" in p:
        raise ToolError(f"path {path!r} contains a NUL character")
    if p.startswith("/"):
        if p != WORKSPACE and not p.startswith(WORKSPACE + "/"):
            raise ToolError(f"path {path!r} is outside {WORKSPACE}; give a path relative to it")
        p = p[len(WORKSPACE) :].lstrip("/")
    if ".." in PurePosixPath(p).parts:
        raise ToolError(f"path {path!r} leaves {WORKSPACE} ('..' is not allowed)")
    return p or "."


def _exec(sandbox, name: str, argv: Sequence[str], timeout: float, stdin: str | None = None):
    try:
        result = sandbox.exec(list(argv), timeout=timeout, stdin=stdin, cwd=WORKSPACE)
    except SandboxError as err:
        raise ToolError(f"{name} could not run: {type(err).__name__}: {err}") from None
    if result.timed_out:
        raise ToolError(f"{name} timed out after {timeout:g} s")
    return result


def _checked(name: str, result) -> str:
    """stdout of a successful command; a non-zero exit is a ToolError carrying the output."""
    if result.exit_code != 0:
        out = (result.stdout + result.stderr).strip()
        if name == "python":  # a traceback: say it was the program that failed, not the tool
            raise ToolError(f"python exited with code {result.exit_code}\n{out}")
        raise ToolError(out or f"{name} exited with code {result.exit_code}")
    return result.stdout.rstrip("\n")


def _run(sandbox, name: str, args: dict, timeout: float) -> str:
    if name == "python":
        return _checked(name, _exec(sandbox, name, [*PYTHON, "-"], timeout, stdin=args["code"]))
    if name == "ls":
        out = _checked(name, _exec(sandbox, name, ["ls", "-1p", "--", workspace_path(args.get("path", "."))], timeout))
        return out or "(empty)"
    if name == "cat":
        return _checked(name, _exec(sandbox, name, ["cat", "--", workspace_path(args["path"])], timeout))
    if name == "grep":
        if not args["pattern"]:
            raise ToolError("grep: the pattern is empty")
        request = {"pattern": args["pattern"], "path": workspace_path(args["path"]), "count": args.get("count", False)}
        return _checked(name, _exec(sandbox, name, [*PYTHON, "-I", "-c", _GREP], timeout, stdin=json.dumps(request)))
    if name == "replace":
        if not args["old"]:
            raise ToolError("replace: old is empty")
        request = {"path": workspace_path(args["path"]), "old": args["old"], "new": args["new"]}
        return _checked(name, _exec(sandbox, name, [*PYTHON, "-I", "-c", _REPLACE], timeout, stdin=json.dumps(request)))
    assert name == "run_tests", name
    result = _exec(sandbox, name, [*PYTHON, TEST_FILE], timeout)
    # Failing tests are run_tests' normal report, not a tool error; a crash's traceback sits at the end.
    return (result.stdout + result.stderr).strip() if result.exit_code else result.stdout.rstrip("\n")


# The in-sandbox halves of grep and replace (arguments as JSON on stdin; failures on stderr with exit 2).
_GREP = r"""
import json, os, sys
a = json.load(sys.stdin)
pattern, root, count = a["pattern"], a["path"], a["count"]
if os.path.isdir(root):
    files = sorted(os.path.normpath(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    many = True
elif os.path.exists(root):
    files, many = [root], False
else:
    sys.exit(f"grep: {root}: No such file or directory")
out = []
for f in files:
    try:
        with open(f, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().split("\n")
    except OSError as e:
        sys.exit(f"grep: {f}: {e.strerror}")
    hits = [line for line in lines if pattern in line]
    if count:
        if not many:
            out.append(str(len(hits)))
        elif hits:
            out.append(f"{f}:{len(hits)}")
    else:
        out += [f"{f}:{line}" if many else line for line in hits]
print("\n".join(out) if out else ("0" if count else "(no matches)"))
"""
_REPLACE = r"""
import json, sys
a = json.load(sys.stdin)
path, old, new = a["path"], a["old"], a["new"]
try:
    with open(path, encoding="utf-8", newline="") as fh:
        text = fh.read()
except OSError as e:
    sys.exit(f"replace: {path}: {e.strerror}")
n = text.count(old)
if n != 1:
    sys.exit(f"replace: old text not found in {path}" if n == 0 else
             f"replace: old text occurs {n} times in {path}; give a longer, unique one")
with open(path, "w", encoding="utf-8", newline="") as fh:
    fh.write(text.replace(old, new, 1))
print("ok")
"""
