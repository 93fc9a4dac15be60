"""Shared helpers for the benchmark scripts: memory of a process tree, timing, page cache, results.

Memory is *peak anonymous memory*: the maximum over time of the SUM of ``RssAnon`` (from
``/proc/PID/status``) over a process and all its descendants, sampled by a monitor thread. Anonymous
memory is what a conversion really holds (heap, tensors); file-backed pages (memory-mapped source
shards, page cache of written outputs) are reclaimable and are reported apart as ``RssFile``.

The kernel here has no ``/proc/PID/task/TID/children``, and a full ``/proc`` scan costs several
milliseconds, so the monitor reads ``RssAnon`` of the known processes every ``interval`` (20 ms) and
rescans ``/proc`` for new descendants every ``rescan`` (250 ms): a descendant that lives less than
that may be missed (worker pools live for the whole run, so they are not).

Usage::

    from _measure import run_measured, machine_info, write_result
    r = run_measured([sys.executable, "-c", "..."])   # {"wall_s", "peak_anon_bytes", ...}
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CpuMonitor",
    "TreeMonitor",
    "cached_fraction",
    "drop_page_cache",
    "machine_info",
    "median",
    "open_sources",
    "proc_pss_anon_kib",
    "proc_status_kib",
    "read_files",
    "replace_marked",
    "run_measured",
    "warm_page_cache",
    "write_result",
]

_READ_BLOCK = 8 << 20
_REPO = Path(__file__).resolve().parents[1]
TINY_SOURCES = ("examples/tiny-deepseek-v3", "examples/tiny-deepseek-v3-trained")


# ------------------------------------------------------------------------------------------------
# process-tree memory


def proc_status_kib(pid: int, keys: Sequence[str] = ("RssAnon", "RssFile")) -> dict[str, int]:
    """``{key: kiB}`` from ``/proc/PID/status`` (missing keys and vanished processes give {})."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.split(b"\n"):
        key, _, rest = line.partition(b":")
        k = key.decode()
        if k in keys:
            out[k] = int(rest.split()[0])
    return out


def proc_pss_anon_kib(pid: int) -> int | None:
    """``Pss_Anon`` of ``pid`` (``/proc/PID/smaps_rollup``): its anonymous pages, each shared
    one (a forked child's copy-on-write pages) divided among its sharers, so a sum over processes
    counts every page once. None where the kernel does not report it or the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss_Anon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _parent_map() -> dict[int, int]:
    """pid → ppid for every process in /proc."""
    out: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rfind(b")") + 2 :].split(None, 2)  # state, ppid, ...
        out[int(d)] = int(rest[1])
    return out


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in _parent_map().items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


class TreeMonitor:
    """Background sampler of the summed RssAnon / RssFile of ``pid`` and its descendants."""

    def __init__(
        self, pid: int, interval: float = 0.02, rescan: float = 0.25, trace: bool = False,
        pss_every: int = 0,
    ) -> None:  # fmt: skip
        self.pid, self.interval, self.rescan = pid, interval, rescan
        self.pss_every = pss_every  # also sum Pss_Anon every this many samples (0: never)
        self.peak_pss_anon_kib: int | None = None
        self.trace: list[tuple[float, int]] | None = [] if trace else None  # (s, anon kiB)
        self._t0 = time.monotonic()
        self.peak_anon_kib = 0
        self.peak_file_kib = 0
        self.peak_procs = 0
        self.samples = 0
        self._pids: set[int] = {pid}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-monitor", daemon=True)

    def __enter__(self) -> TreeMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def sample(self) -> None:
        anon = file = alive = 0
        for p in list(self._pids):
            st = proc_status_kib(p)
            if not st:  # exited (or a zombie): forget it, but keep watching the root
                if p != self.pid:
                    self._pids.discard(p)
                continue
            alive += 1
            anon += st.get("RssAnon", 0)
            file += st.get("RssFile", 0)
        self.samples += 1
        if self.pss_every and self.samples % self.pss_every == 1:
            pss = [proc_pss_anon_kib(p) for p in list(self._pids)]
            if any(v is not None for v in pss):
                total = sum(v or 0 for v in pss)
                self.peak_pss_anon_kib = max(self.peak_pss_anon_kib or 0, total)
        if self.trace is not None:
            self.trace.append((round(time.monotonic() - self._t0, 3), anon))
        self.peak_anon_kib = max(self.peak_anon_kib, anon)
        self.peak_file_kib = max(self.peak_file_kib, file)
        self.peak_procs = max(self.peak_procs, alive)

    def _loop(self) -> None:
        next_scan = 0.0
        while True:
            now = time.monotonic()
            if now >= next_scan:
                self._pids |= _descendants(self.pid)
                next_scan = now + self.rescan
            self.sample()
            if self._stop.wait(self.interval):
                self.sample()  # one last look (the process has exited by now: usually zeros)
                return


class CpuMonitor:
    """Background sampler of how many CPU cores are busy, machine-wide (``/proc/stat``): every
    ``interval`` s, (seconds since start, busy cores) from the change in non-idle jiffies; and
    of the page cache's traffic to the disks (``/proc/vmstat``): ``io_trace`` (seconds, dirty
    MB, under write-back MB, MB/s written to block devices since the last sample)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.trace: list[tuple[float, float]] = []
        self.io_trace: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-monitor", daemon=True)

    @staticmethod
    def _read() -> tuple[float, float]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return float(sum(vals[:8]) - idle), float(sum(vals[:8]))

    @staticmethod
    def _vmstat() -> tuple[float, float, float]:
        """(dirty MB, write-back MB, MB written to block devices so far)."""
        keys = {"nr_dirty": 0.0, "nr_writeback": 0.0, "pgpgout": 0.0}
        try:
            with open("/proc/vmstat") as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k in keys:
                        keys[k] = float(v)
        except OSError:
            pass
        page_mb = (os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096) / 1e6
        return keys["nr_dirty"] * page_mb, keys["nr_writeback"] * page_mb, keys["pgpgout"] / 1e3

    def __enter__(self) -> CpuMonitor:
        self._t0 = time.monotonic()
        self._last = self._read()
        self._last_io = (self._t0, self._vmstat()[2])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        cores = os.cpu_count() or 1
        while not self._stop.wait(self.interval):
            busy, total = self._read()
            d_busy, d_total = busy - self._last[0], total - self._last[1]
            self._last = (busy, total)
            if d_total > 0:
                t = round(time.monotonic() - self._t0, 3)
                self.trace.append((t, round(cores * d_busy / d_total, 2)))
            now, (dirty, wb, out) = time.monotonic(), self._vmstat()
            rate = (out - self._last_io[1]) / max(1e-6, now - self._last_io[0])
            self._last_io = (now, out)
            t = round(now - self._t0, 3)
            self.io_trace.append((t, round(dirty), round(wb), round(rate)))


def run_measured(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    interval: float = 0.02,
    check: bool = True,
    trace: bool = False,
    pss_every: int = 0,
    cpu_interval: float = 0.0,
    preexec_fn: Any = None,
) -> dict[str, Any]:
    """Run ``cmd``; return wall and CPU time, peak anon / file memory of its tree, exit code, output.

    Wall time runs from just before ``Popen`` to the process's exit (interpreter start-up
    included). CPU time (user, system) comes from ``wait4`` and covers the process and the
    descendants it waited for; it moves less than wall time when other work shares the CPUs, but
    it still grows under contention (shared caches, hypervisor steal counted as user time). The
    1-minute load average at the start is recorded to show such sharing. ``trace=True`` adds the
    sampled ``(seconds, summed RssAnon kiB)`` series as ``anon_trace_kib``. stdout and stderr are
    captured to temporary files (not pipes: no risk of a full pipe blocking the child).
    """
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        cpu = CpuMonitor(cpu_interval) if cpu_interval else contextlib.nullcontext()
        with cpu:
            proc = subprocess.Popen(
                list(cmd), stdout=out, stderr=err, env=env, cwd=cwd, preexec_fn=preexec_fn
            )
            with TreeMonitor(proc.pid, interval=interval, trace=trace, pss_every=pss_every) as mon:
                _, status, usage = os.wait4(proc.pid, 0)
                wall = time.perf_counter() - t0
        rc = proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if check and rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return {
        "wall_s": wall,
        "cpu_user_s": usage.ru_utime,  # the process and its waited-for descendants
        "cpu_sys_s": usage.ru_stime,
        "loadavg_1min_before": load,  # other load on the machine when it started
        "peak_anon_bytes": mon.peak_anon_kib * 1024,
        "peak_file_bytes": mon.peak_file_kib * 1024,
        "peak_processes": mon.peak_procs,
        "samples": mon.samples,
        "returncode": rc,
        "stdout": stdout,
        "stderr": stderr,
        **({"anon_trace_kib": mon.trace} if trace else {}),
        **({"peak_pss_anon_bytes": (mon.peak_pss_anon_kib or 0) * 1024} if pss_every else {}),
        **({"busy_cores_trace": cpu.trace} if cpu_interval else {}),  # type: ignore[union-attr]
        **({"io_trace": cpu.io_trace} if cpu_interval else {}),  # type: ignore[union-attr]
    }


# ------------------------------------------------------------------------------------------------
# page cache


def read_files(paths: Iterable[str | os.PathLike[str]], block: int = _READ_BLOCK) -> int:
    """Read every byte of ``paths`` with ``block``-byte ``readinto`` calls into one reused buffer
    (a raw sequential read); returns the bytes read."""
    view = memoryview(bytearray(block))
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def warm_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Read every byte of ``paths`` (8 MB reads) so they sit in the page cache; returns bytes."""
    return read_files(paths)


def cached_fraction(paths: Iterable[str | os.PathLike[str]]) -> float | None:
    """Fraction of the pages of ``paths`` resident in the page cache (``mincore``), or None.

    Worth checking: a kernel may evict cold page cache on its own (this VM runs DAMON with a
    ``pageout`` scheme for memory idle ~30 s), so "warm" has to be re-established and verified.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if not size:
                continue
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                n = -(-size // page)
                vec = (ctypes.c_ubyte * n)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in bytes(vec))
                total += n
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def drop_page_cache(paths: Iterable[str | os.PathLike[str]] = ()) -> str:
    """Evict clean cached pages; returns how ('drop_caches', 'fadvise' or 'none').

    As root, ``sync`` then ``echo 1 > /proc/sys/vm/drop_caches`` (the whole page cache). Otherwise
    ``posix_fadvise(DONTNEED)`` on each of ``paths`` (works unprivileged, for clean pages of those
    files only). Returns 'none' when neither was possible.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    done = False
    if hasattr(os, "posix_fadvise"):
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done = True
            finally:
                os.close(fd)
    return "fadvise" if done else "none"


# ------------------------------------------------------------------------------------------------
# machine and results


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _git_commit(repo: Path) -> str | None:
    try:
        r = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        head = r.stdout.strip() or None
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return None
    return f"{head}{'+dirty' if dirty else ''}" if head else None


def machine_info() -> dict[str, Any]:
    """Facts a result needs to be compared: CPUs, memory, kernel, Python, torch, date, commit."""
    try:
        import torch

        torch_version, threads = torch.__version__, torch.get_num_threads()
    except ImportError:
        torch_version, threads = None, None
    try:
        import safetensors

        st_version = safetensors.__version__
    except ImportError:
        st_version = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_bytes": _mem_total(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "torch_threads": threads,
        "safetensors": st_version,
        "git_commit": _git_commit(Path(__file__).resolve().parent.parent),
        "argv": sys.argv,
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def write_result(path: str | os.PathLike[str], doc: dict[str, Any]) -> Path:
    """Write ``doc`` as indented JSON to ``path`` (parents created, replaced atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def replace_marked(path: Path, start: str, end: str, text: str) -> bool:
    """Replace what lies between the ``start`` and ``end`` markers of ``path`` by ``text``
    (written atomically); False, and the file untouched, when a marker is missing."""
    body = path.read_text(encoding="utf-8") if path.exists() else ""
    if start not in body or end not in body:
        return False
    a, b = body.index(start), body.index(end) + len(end)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(body[:a] + f"{start}\n{text}{end}" + body[b:], encoding="utf-8")
    os.replace(tmp, path)
    return True


def open_sources(description: str) -> list[tuple[str, Any]]:
    """(argument, ``SourceCheckpoint``) of each SOURCE on the command line of a script measuring
    checkpoints (default: the two embedded tiny models; relative paths from the repository)."""
    import argparse

    from hetquant.convert import SourceCheckpoint

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("sources", nargs="*", default=list(TINY_SOURCES))
    args = ap.parse_args()
    return [(s, SourceCheckpoint.open(_REPO / s)) for s in args.sources]
