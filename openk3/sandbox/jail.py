"""Running something as the sandbox user: the supervisor forks a child that chroots into the sandbox's root, drops to
uid/gid 1000 (no capabilities left; no_new_privs is inherited from the supervisor, so setuid binaries of the host's
/usr grant nothing) and takes the sandbox's rlimits; then either execs a command (`exec_command`) or does one file
operation as that user (`file_op`), so a symlink or `..` can only ever resolve inside the sandbox's root and the
sandbox user's permissions apply. `pump` moves the bytes and enforces the deadline.

Stdlib only; the supervisor loads this file as a top-level module.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import select
import signal
import stat
import time

UID = 1000  # the sandbox user inside (host uid 101000 through the uid map)
OUTPUT_CAP = 1 << 20  # bytes of stdout and of stderr an ExecResult carries
MAX_READ = 1 << 30  # the largest file read_file returns
FILE_DEADLINE_S = 50.0  # a file operation's own limit, under the backend's call deadline
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin", "HOME": "/workspace",
            "LANG": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox", "SHELL": "/bin/sh"}  # fmt: skip
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGCHLD)
_tracked: dict[int, int | None] = {}  # children whose exit status a caller waits for (pid -> status once reaped)


def reap() -> None:
    """Reap every exited child without blocking: the supervisor is PID 1, so orphans of the sandbox end up here."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in _tracked:
            _tracked[pid] = status


def _wait(pid: int) -> int:
    status = _tracked.pop(pid, None)
    return status if status is not None else os.waitpid(pid, 0)[1]


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def enter(root: str, cwd: str, rlimits: list[tuple[int, int]]) -> None:
    """Become the sandbox user inside `root` (called in a freshly forked child of the supervisor)."""
    os.chroot(root)
    os.chdir("/")
    os.umask(0o022)
    os.setresgid(UID, UID, UID)  # supplementary groups were cleared in the zygote, before any user namespace
    os.setresuid(UID, UID, UID)
    for res, value in rlimits:
        resource.setrlimit(res, (value, value))
    os.chdir(cwd)  # as the sandbox user: its permissions decide


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def pump(pid: int, deadline: float, outs: list[int], caps: list[int], stdin: tuple[int, bytes] | None = None,
         kill=None, grace_s: float = 2.0) -> tuple[list[bytes], list[bool], int, bool]:  # fmt: skip
    """Feed `stdin`, collect `outs` (each capped; past its cap bytes are read and dropped so the writer never blocks)
    until the child exits; at `deadline` call `kill`. Returns (outputs, cut flags, wait status, timed out). Outputs
    still held open by the child's own background processes are drained, not waited for."""
    _tracked[pid] = None
    pidfd = os.pidfd_open(pid)
    bufs, cut = [bytearray() for _ in outs], [False] * len(outs)
    index = {fd: i for i, fd in enumerate(outs)}
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    for fd in outs:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    if stdin is not None:
        w_fd, view = stdin[0], memoryview(stdin[1])
        os.set_blocking(w_fd, False)
        poller.register(w_fd, select.POLLOUT)

    def read(fd: int, budget: int = 1 << 16) -> bool:
        try:
            data = os.read(fd, budget)
        except BlockingIOError:
            return False
        i = index[fd]
        room = caps[i] - len(bufs[i])
        bufs[i] += data[:room]
        cut[i] |= len(data) > room
        return bool(data)

    exited = timed_out = False
    while not exited:
        now = time.monotonic()
        if now >= deadline:
            if timed_out:
                break
            if kill is not None:
                kill()
            timed_out, deadline = True, now + grace_s
        for fd, _ev in poller.poll(max(0.0, deadline - now) * 1000):
            if fd == pidfd:
                exited = True
            elif stdin is not None and fd == w_fd:
                try:
                    view = view[os.write(w_fd, view[: 1 << 16]) :]
                except OSError:  # the child closed its stdin: the rest is not wanted
                    view = view[:0]
                if not view:
                    poller.unregister(w_fd)
                    os.close(w_fd)
                    stdin = None
            elif not read(fd):
                poller.unregister(fd)
        reap()
    drained = 0
    for fd in outs:
        while drained < 8 * OUTPUT_CAP and read(fd):
            drained += 1 << 16
        os.close(fd)
    if stdin is not None:
        os.close(w_fd)
    os.close(pidfd)
    return [bytes(b) for b in bufs], cut, _wait(pid), timed_out


def _fork(fds: tuple[int, ...]) -> int:
    """Fork a child whose fds 0, 1, 2 (and 3: a close-on-exec status pipe) are `fds`, holding no other descriptor of
    the supervisor (its sockets are close-on-exec, but a file helper never execs). The sources are all >= 3: the
    supervisor keeps its own 0-2 open."""
    pid = os.fork()
    if pid == 0:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        if len(fds) > 3:
            os.set_inheritable(3, False)
        os.closerange(len(fds), 1 << 20)
    return pid


class CwdError(OSError):
    """An exec's working folder cannot be entered by the sandbox user."""


def _oserror(payload: bytes, kind=OSError) -> OSError:
    err, msg, path = json.loads(payload)
    return kind(err, msg, path) if err is not None else kind(msg)


def exec_command(root: str, rlimits, h: dict, stdin: bytes | None) -> tuple[list[bytes], list[bool], int, bool, float]:
    """Run h["argv"] as the sandbox user in h["cwd"] for at most h["timeout"] seconds. Returns (stdout and stderr,
    their cut flags, exit code, timed out, duration). A missing cwd raises (the caller's mistake); a missing command
    is exit 127 with the reason on stderr, as a shell would say it."""
    argv, cwd, env = h["argv"], h["cwd"], dict(BASE_ENV, **h["env"])
    in_r, in_w = os.pipe() if stdin is not None else (os.open("/dev/null", os.O_RDONLY), None)
    (out_r, out_w), (err_r, err_w), (st_r, st_w) = os.pipe(), os.pipe(), os.pipe()
    start = time.monotonic()
    pid = _fork((in_r, out_w, err_w, st_w))
    if pid == 0:
        try:
            os.setsid()  # its own process group: a timeout kills the command and everything it started
            try:
                enter(root, cwd, rlimits)
            except OSError as e:
                os.write(3, json.dumps([e.errno, e.strerror, cwd]).encode())
                os._exit(1)
            for sig in _DEFAULT_SIGNALS:  # the supervisor ignores some; a command starts with the defaults
                signal.signal(sig, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        except BaseException as e:  # noqa: BLE001 (whatever failed, the child must never return into the supervisor)
            msg = e.strerror if isinstance(e, OSError) else repr(e)
            os.write(2, f"{argv[0]}: {msg}\n".encode(errors="replace"))
            os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    for fd in (in_r, out_w, err_w, st_w):
        os.close(fd)

    def kill() -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # killed before its setsid: the group does not exist yet
            os.kill(pid, signal.SIGKILL)

    stdin_arg = (in_w, stdin) if stdin is not None else None
    (out, err, status_msg), cut, status, timed_out = pump(pid, start + h["timeout"], [out_r, err_r, st_r],
                                                           [OUTPUT_CAP, OUTPUT_CAP, 4096], stdin_arg, kill)  # fmt: skip
    duration = time.monotonic() - start
    if timed_out:  # the group's other members die too: wait until they are reaped, so the sandbox is quiet again
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            reap()
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.001)
    if status_msg:
        raise _oserror(status_msg, CwdError)
    return [out, err], cut[:2], _exit_code(status), timed_out, duration


def _file_write(h: dict) -> None:
    path, mode = h["path"], h["mode"]
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    # O_NONBLOCK: a FIFO planted at `path` fails (ENXIO) instead of blocking the helper
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode)
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:  # an existing file keeps its mode through O_CREAT; umask
        os.fchmod(fd, mode)
    while chunk := os.read(0, 1 << 20):
        _write_all(fd, chunk)
    os.close(fd)


def _file_read(h: dict) -> None:
    path = h["path"]
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", path)
    if st.st_size > MAX_READ:
        raise OSError(errno.EFBIG, f"larger than read_file's {MAX_READ} bytes", path)
    os.set_blocking(fd, True)
    while chunk := os.read(fd, 1 << 20):
        _write_all(1, chunk)


def _file_list(h: dict) -> None:
    out = []
    with os.scandir(h["path"]) as it:
        for e in it:
            st = e.stat(follow_symlinks=False)
            kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                    else "symlink" if stat.S_ISLNK(st.st_mode) else "other")  # fmt: skip
            out.append([e.name, kind, st.st_size, stat.S_IMODE(st.st_mode)])
    _write_all(1, json.dumps(sorted(out)).encode())


FILE_OPS = {"write_file": _file_write, "read_file": _file_read, "list_dir": _file_list}


def file_op(root: str, rlimits, h: dict, data: bytes | None) -> bytes:
    """Do one file operation (FILE_OPS) as the sandbox user; returns what it wrote (file bytes, a listing). OSError
    as the sandbox user met it, with the sandbox path."""
    in_r, in_w = os.pipe() if data is not None else (os.open("/dev/null", os.O_RDONLY), None)
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    pid = _fork((in_r, out_w, err_w))
    if pid == 0:
        code = 0
        try:
            enter(root, "/", rlimits)
            if os.path.isdir("/workspace"):
                os.chdir("/workspace")  # relative paths are the sandbox user's home-relative, as in exec
            FILE_OPS[h["op"]](h)
        except OSError as e:
            os.write(2, json.dumps([e.errno, e.strerror, e.filename]).encode())
            code = 1
        except BaseException as e:  # noqa: BLE001
            os.write(2, json.dumps([None, repr(e), None]).encode())
            code = 2
        os._exit(code)
    for fd in (in_r, out_w, err_w):
        os.close(fd)

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)

    stdin_arg = (in_w, data) if data is not None else None
    (out, err), _cut, status, timed_out = pump(pid, time.monotonic() + FILE_DEADLINE_S, [out_r, err_r],
                                               [MAX_READ, 1 << 16], stdin_arg, kill)  # fmt: skip
    if timed_out:
        raise OSError(errno.ETIMEDOUT, f"{h['op']} took over {FILE_DEADLINE_S:g} s", h.get("path"))
    if err:
        raise _oserror(err)
    if status != 0:
        raise OSError(f"{h['op']}: the helper died ({_exit_code(status)})")
    return out
