#!/usr/bin/env python3
"""How well does training state compress, and does an XOR delta against the parent help?

Reads two snapshots of the same run (any format titan3d writes: each shard's boxes, incremental
ones rebuilt along the chain) and, per section
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


def text(attr):
    return attr.decode() if isinstance(attr, bytes) else str(attr)


def values(index_path):
    """{tensor path: flat fp32 array of the global tensor} of a snapshot, read from its shards and
    rebuilt along its chain: format 2 copies a `changed/` box's stored chunks (`chunk_written`)
    over the parent's, format 1 XORs `xor/` masks into it."""
    folder = os.path.dirname(index_path)
    with h5py.File(index_path, "r") as f:
        parent = text(f.attrs["parent"])
        files = text(f.attrs["shard_files"]).split("\n")
    out = values(os.path.join(folder, parent)) if parent else {}
    for rel in files:
        with h5py.File(os.path.join(folder, rel), "r") as shard:
            for name in text(shard.attrs["tensors"]).split("\n"):
                ds = shard[name]
                kind, _, rest = name.partition("/")
                if kind not in ("xor", "changed"):
                    kind, rest = "values", name
                tensor = rest.split("~")[0]
                shape = tuple(int(n) for n in ds.attrs["global_shape"])
                whole = out.setdefault(tensor, np.zeros(int(np.prod(shape)), np.float32)).reshape(shape)
                box = tuple(slice(int(o), int(o) + n) for o, n in zip(ds.attrs["offset"], ds.shape))
                data = ds[...].astype(np.float32)
                if kind == "values":
                    whole[box] = data
                elif kind == "xor":
                    whole[box] = (whole[box].view(np.uint32) ^ data.view(np.uint32)).view(np.float32)
                else:
                    chunk, now = int(ds.attrs["chunk_elems"]), whole[box].ravel()
                    for c, stored in enumerate(ds.attrs["chunk_written"]):
                        if stored:
                            now[c * chunk:(c + 1) * chunk] = data.ravel()[c * chunk:(c + 1) * chunk]
                    whole[box] = now.reshape(data.shape)
    return out


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
