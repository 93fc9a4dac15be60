"""How fast one sha256 stream runs on this host, alone and beside busy workers (issue #16).

Prints the CPU's SHA extensions, OpenSSL's own figure, and hashlib's rate on a buffer in memory,
read back with preadv (8 MB, 1 MB and 256 KB reads) from a file on tmpfs (what
convert/engine/hashing.py does), and through mmap,
each alone and with N processes copying memory (the converters' load). JSON on stdout.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

SIZE = 2 << 30
READ = 8 << 20


def busy(stop: mp.Event) -> None:  # memory-bound like a converter: ~64 MB copies
    a = np.ones(8 << 20, dtype=np.float64)
    b = np.empty_like(a)
    while not stop.is_set():
        np.multiply(a, 1.0001, out=b)


def rate(fn) -> float:
    t = time.perf_counter()
    fn()
    return SIZE / (time.perf_counter() - t) / 1e9


def by_buffer(data: bytes) -> None:
    h = hashlib.sha256()
    mv = memoryview(data)
    for i in range(0, SIZE, READ):
        h.update(mv[i : i + READ])


def by_preadv(path: str, read: int = READ) -> None:
    fd, buf, h = os.open(path, os.O_RDONLY), bytearray(read), hashlib.sha256()
    view = memoryview(buf)
    for pos in range(0, SIZE, read):
        n = os.preadv(fd, [view], pos)
        h.update(view[:n])
    os.close(fd)


def by_mmap(path: str) -> None:
    fd, h = os.open(path, os.O_RDONLY), hashlib.sha256()
    m = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
    m.madvise(mmap.MADV_SEQUENTIAL)
    mv = memoryview(m)
    for i in range(0, SIZE, READ):
        h.update(mv[i : i + READ])
    mv.release()
    m.close()
    os.close(fd)


def main() -> None:
    flags = open("/proc/cpuinfo").read()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in flags.splitlines() if "model name" in ln), "?"
    )
    out = {"cpu": model, "sha_ni": " sha_ni " in flags, "cores": os.cpu_count()}
    try:
        out["openssl_speed"] = (
            subprocess.run(
                ["openssl", "speed", "-seconds", "2", "-bytes", "16384", "-evp", "sha256"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
    except Exception as e:
        out["openssl_speed"] = repr(e)
    out["hashlib_openssl"] = (
        hashlib.sha256().__class__.__module__
        + " "
        + getattr(__import__("ssl"), "OPENSSL_VERSION", "?")
    )
    data = os.urandom(SIZE)
    path = "/dev/shm/sha_probe.bin"
    with open(path, "wb") as f:
        f.write(data)
    for load in (0, int(sys.argv[1]) if len(sys.argv) > 1 else 16):
        stop = mp.Event()
        procs = [mp.Process(target=busy, args=(stop,)) for _ in range(load)]
        for p in procs:
            p.start()
        time.sleep(0.5)
        out[f"load{load}"] = {
            "buffer": rate(lambda: by_buffer(data)),
            "preadv": rate(lambda: by_preadv(path)),
            "preadv_1m": rate(lambda: by_preadv(path, 1 << 20)),
            "preadv_256k": rate(lambda: by_preadv(path, 256 << 10)),
            "mmap": rate(lambda: by_mmap(path)),
        }
        stop.set()
        for p in procs:
            p.join()
    os.unlink(path)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
