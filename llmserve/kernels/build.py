"""Building a C++ extension once per machine and source version, so that no start-up can hang on another's build.

The build goes into a private folder, which is moved into place when it is done: a build killed half-way leaves
nothing another process would wait on. A lock file naming its owner (host and pid) keeps two processes from building
the same thing at once; a lock whose owner is gone is taken over, and a process that waits says on whom after a few
seconds. The cache is keyed by the sources' contents (not their paths), the flags, torch and Python, so a checkout
beside an installed copy of the same sources reuses one build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
WAIT_MESSAGE_AFTER_S = 3.0


def build_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root)


def build_key(sources: list[Path], headers: list[Path], cflags: list[str], extra: str = "") -> str:
    digest = hashlib.sha256()
    for path in (*sources, *headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(repr((cflags, torch.__version__, sys.version_info[:2], extra)).encode())
    return digest.hexdigest()[:16]


def _say(message: str) -> None:
    print(f"llmserve: {message}", file=sys.stderr, flush=True)


def _owner_alive(lock: Path) -> tuple[bool, str]:
    """Whether the process named in the lock still runs (on this host), and who it is."""
    try:
        host, pid = lock.read_text().split()
        pid_n = int(pid)
    except (OSError, ValueError):  # being written, or unreadable: judged by age
        try:
            return time.time() - lock.stat().st_mtime < 10, "an unknown process"
        except OSError:
            return False, "a finished process"
    if host != socket.gethostname():
        return True, f"process {pid_n} on {host}"
    try:
        os.kill(pid_n, 0)
    except ProcessLookupError:
        return False, f"process {pid_n}"
    except PermissionError:  # another user's live process
        pass
    return True, f"process {pid_n}"


def _acquire(lock: Path, library: Path, what: str) -> bool:
    """Takes the lock (True), or returns False once another process has built the library."""
    waited_since, told = time.monotonic(), False
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}")
            return True
        except FileExistsError:
            pass
        if library.exists():
            return False
        alive, owner = _owner_alive(lock)
        if not alive:
            logger.warning("removing a stale build lock left by %s: %s", owner, lock)
            lock.unlink(missing_ok=True)
            continue
        if not told and time.monotonic() - waited_since > WAIT_MESSAGE_AFTER_S:
            _say(f"waiting for {owner}, which is building {what} (lock: {lock})")
            told = True
        time.sleep(0.2)


def load_extension(prefix: str, sources: list[Path], headers: list[Path], cflags: list[str], what: str,
                   extra_key: str = "") -> Path:
    """Builds (if no build of these exact sources is cached) and loads the extension; returns the library's path."""
    key = build_key(sources, headers, cflags, extra_key)
    name = f"{prefix}_{key}"
    root = build_root()
    final = root / name
    library = final / f"{name}.so"
    if not library.exists():
        root.mkdir(parents=True, exist_ok=True)
        lock = root / f"{name}.lock"
        if _acquire(lock, library, what):
            try:
                if not library.exists():
                    _build(root, final, name, sources, headers, cflags, what)
                    return library  # the build loaded it (a library is loaded once per process)
            finally:
                lock.unlink(missing_ok=True)
    torch.ops.load_library(str(library))
    return library


def _build(root: Path, final: Path, name: str, sources, headers, cflags, what: str) -> None:
    from torch.utils import cpp_extension

    for stale in root.glob(f"{name}.build-*"):  # left by builds that were killed
        shutil.rmtree(stale, ignore_errors=True)
    private = root / f"{name}.build-{os.getpid()}"
    src = private / "src"
    src.mkdir(parents=True)
    for path in (*sources, *headers):
        shutil.copy2(path, src / path.name)
    _say(f"building {what} (once per machine and version; about a minute on 2 cores) ...")
    t0 = time.perf_counter()
    try:
        # Builds and loads it; the open library stays valid when its folder moves.
        cpp_extension.load(name=name, sources=[str(src / p.name) for p in sources], extra_cflags=cflags,
                           build_directory=str(private), is_python_module=False, verbose=False)
        os.rename(private, final)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    _say(f"built {what} in {time.perf_counter() - t0:.0f} s")
