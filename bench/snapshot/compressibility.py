#!/usr/bin/env python3
"""How well does training state compress, and does an XOR delta against the parent help?

Reads two snapshots of the same run (any encoding titan3d writes: h5py sees the index's
virtual datasets; incremental ones are rebuilt by XOR along the chain) and, per section
(parameters, exp_avg, exp_avg_sq), compresses every 1 MiB chunk the way HDF5's filters would:
byte shuffle (the shuffle filter's transposition) then zlib at each level. Three encodings:
  plain   shuffle + deflate of the values themselves (what a compressed full base costs)
  xor     shuffle + deflate of new XOR parent (what an incremental snapshot costs)
Prints the compressed share of the raw bytes and single-core deflate throughput.

  python3 bench/snapshot/compressibility.py runs/x/snapshots/step_00000010.h5 runs/x/snapshots/step_00000015.h5
"""
import os
import sys
import time
import zlib

import h5py
import numpy as np

CHUNK = 1 << 18  # elements, as titan3d's content-hash chunks


def values(index_path):
    """{dataset path: fp32 array} of a snapshot, rebuilding incremental ones along the chain."""
    with h5py.File(index_path, "r") as f:
        parent = f.attrs["parent"].decode() if isinstance(f.attrs["parent"], bytes) else f.attrs["parent"]
        prefix = "xor/" if parent else ""
        out = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and name.startswith(prefix) and name.split("/")[0] != "state":
                out[name[len(prefix):]] = obj[...].astype(np.float32).ravel()

        f.visititems(visit)
    if not parent:
        return out
    base = values(os.path.join(os.path.dirname(index_path), parent))
    return {k: (base[k].view(np.uint32) ^ v.view(np.uint32)).view(np.float32) for k, v in out.items()}


def shuffled_chunks(a):
    for i in range(0, a.size, CHUNK):
        yield np.ascontiguousarray(a[i:i + CHUNK].view(np.uint8).reshape(-1, 4).T).tobytes()


def main():
    old, new = values(sys.argv[1]), values(sys.argv[2])
    sections = {"model/": "params", "optim/exp_avg/": "exp_avg", "optim/exp_avg_sq/": "exp_avg_sq"}
    print(f"{'section':<11} {'MB raw':>8} {'enc':<6} " + " ".join(f"{'lvl' + str(l):>7}" for l in (1, 6))
          + "  MiB/s(lvl1, lvl6)")
    for prefix, label in sections.items():
        keys = sorted(k for k in new if k.startswith(prefix))
        a = np.concatenate([new[k] for k in keys])
        b = np.concatenate([old[k] for k in keys])
        xor = (a.view(np.uint32) ^ b.view(np.uint32)).view(np.float32)
        for enc, data in (("plain", a), ("xor", xor)):
            shares, speeds = [], []
            for level in (1, 6):
                t0 = time.perf_counter()
                size = sum(len(zlib.compress(c, level)) for c in shuffled_chunks(data))
                dt = time.perf_counter() - t0
                shares.append(f"{100 * size / data.nbytes:6.1f}%")
                speeds.append(f"{data.nbytes / 2**20 / dt:.0f}")
            print(f"{label:<11} {a.nbytes / 1e6:8.2f} {enc:<6} " + " ".join(shares) + "  " + ", ".join(speeds))
        same = np.count_nonzero(a.view(np.uint32) == b.view(np.uint32))
        print(f"{'':<11} unchanged values: {100 * same / a.size:.1f}%")


if __name__ == "__main__":
    main()
