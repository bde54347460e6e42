"""Where the weight versions handed to the engines live: a directory per run, on /dev/shm if room.

Plumbing for PipelineRL's in-flight weight updates (arXiv 2510.13786 §3.1): the trainer saves each
published version into a fresh directory of the run's root (`WeightDirs.new`, through
pipeline.Pipeline.weights_dir), the training engine loads it from there and the pipeline deletes
it; the eval engine (infra/evals.py) keeps the version it evaluates as a snapshot of hard links in
the same root (`WeightDirs.snapshot`, no copy). The root is named after the process that owns it,
so a later run deletes what a killed one left behind; the run's watchdog deletes it too. Exercised
by `pytest tests/test_pipeline.py`.

Where it departs from the paper, and why (the paper does not say how weights reach its
generators):
1. Weights travel as safetensors directories on /dev/shm (RAM-backed) when it has room, else in
   the run directory (`weights_parent`); the NCCL path (infra/engine.py) skips the disk.
"""

import glob
import os
import re
import shutil
import tempfile

import psutil

# weight directories alive at once: one loading, one published and waiting, one being written
VERSIONS_ALIVE = 3


def weights_root(parent: str | None = None) -> str:
    """A fresh directory for the weight versions handed to the sampler, in `parent` (default:
    /dev/shm where there is one, so vLLM reloads from memory; see weights_parent). Named
    pipeline_<pid>-<process start time>_*, so the ones a killed run left behind in `parent` are
    known and deleted here first (the run's watchdog normally deleted them already)."""
    if parent is None:
        parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for path in glob.glob(os.path.join(parent, "pipeline_*-*_*")):
        owner = re.match(r"pipeline_(\d+)-(\d+)_", os.path.basename(path))
        try:
            alive = owner and int(psutil.Process(int(owner[1])).create_time()) == int(owner[2])
        except psutil.NoSuchProcess:
            alive = False
        except psutil.Error:  # another user's process: not ours to judge
            alive = True
        if owner and not alive:
            shutil.rmtree(path, ignore_errors=True)
    me = psutil.Process()
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"pipeline_{me.pid}-{int(me.create_time())}_", dir=parent)


def weights_parent(
    weights_bytes: int,
    fallback: str | None,
    shm: str = "/dev/shm",
    free_bytes=None,
    versions: int = VERSIONS_ALIVE,
) -> str | None:
    """Where weight versions are written for the disk path: `shm` (RAM-backed) when it exists and
    has room for `versions` versions of `weights_bytes` each (parameters x the sampler dtype's
    bytes; infra/generator.py counts VERSIONS_ALIVE + the eval snapshots), else `fallback` (the run
    directory; None: the system temp dir, weights_root's default). Containers often give /dev/shm
    64 MB, an 8B model needs 49 GB. free_bytes(path) -> bytes free there (default:
    shutil.disk_usage), injectable for tests."""
    free_bytes = free_bytes or (lambda path: shutil.disk_usage(path).free)
    if os.path.isdir(shm) and free_bytes(shm) >= versions * weights_bytes:
        return shm
    return fallback


def snapshot(weights: str, parent: str, version: int) -> str:
    """A new directory in `parent` holding the files of `weights` as hard links (copies on a
    filesystem without them): the eval keeps version `version` after the training engine deleted
    `weights`."""
    out = tempfile.mkdtemp(prefix=f"eval_v{version}_", dir=parent)
    for name in os.listdir(weights):
        src = os.path.join(weights, name)
        dst = os.path.join(out, name)
        try:
            os.link(src, dst)
        except OSError:  # a filesystem without hard links
            shutil.copy2(src, dst)
    return out


class WeightDirs:
    """The weight directories of one root (`weights_root(parent)`): fresh ones for published
    versions (`new`), snapshots for evals (`snapshot`); `remove` and `owns` tell ours from the
    directories a caller passes in (the start model: never deleted). `close` deletes the root and
    everything in it. Shared by the pipeline and the eval engine (hard links need one filesystem);
    closed by whoever made it."""

    def __init__(self, parent: str | None = None):
        self.root = weights_root(parent)

    def new(self, version: int) -> str:
        """A fresh directory to save version `version` into."""
        return tempfile.mkdtemp(prefix=f"v{version}_", dir=self.root)

    def owns(self, path: str) -> bool:
        """Is `path` a directory of this root (`new`, `snapshot`)?"""
        return os.path.dirname(os.path.abspath(path)) == self.root

    def snapshot(self, path: str, version: int) -> str:
        """A snapshot of `path` in this root (see `snapshot`)."""
        return snapshot(path, self.root, version)

    def remove(self, path: str) -> None:
        """Delete `path` if it is one of ours; leave any other directory alone."""
        if self.owns(path):
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
