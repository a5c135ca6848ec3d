"""The per-step losses of runs under one log directory and how far apart they are: shared by the
GPU checks (scripts/gpu_train_check.sh, scripts/gpu_layout_check.sh), and bundled beside them."""
import json


def losses(logs, name):
    """step -> loss from LOGS/NAME/metrics.jsonl, the last logged for a step (a restarted run logs
    some again); {} when the run left no metrics (it failed, and its script said so). A line that
    is not JSON (a run killed mid-write) is skipped: the comparison then finds the step missing,
    and the other runs' comparisons still print."""
    out = {}
    try:
        lines = open(f"{logs}/{name}/metrics.jsonl").readlines()
    except OSError:
        return out
    for line in lines:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if "loss" in m and "step" in m:
            out[m["step"]] = m["loss"]
    return out


def worst(a, b):
    """The largest relative difference of a from b over b's steps; inf where a lacks one."""
    return max((abs(a[s] - b[s]) / abs(b[s]) if s in a else float("inf") for s in b),
               default=float("inf"))


def snapshot_differences(dir_a, dir_b, groups=("model", "optim")):
    """(steps compared, differences) between the snapshots two runs wrote in DIR_A and DIR_B
    (step_*.h5 indexes, read through h5py as global tensors): every dataset under GROUPS of each
    step both hold, compared bit for bit (NaNs equal where both are NaN at the same place). A
    difference is 'step_N.h5 /path: what'; no common step is itself one."""
    import glob
    import os
    import h5py
    import numpy as np
    names = sorted(set(os.path.basename(p) for p in glob.glob(f"{dir_a}/step_*.h5")) &
                   set(os.path.basename(p) for p in glob.glob(f"{dir_b}/step_*.h5")))
    out = [] if names else [f"no snapshot of the same step in {dir_a} and {dir_b}"]
    for name in names:
        with h5py.File(f"{dir_a}/{name}", "r") as fa, h5py.File(f"{dir_b}/{name}", "r") as fb:
            paths = []
            for g in groups:
                if g in fa:
                    fa[g].visititems(lambda p, o, g=g: paths.append(f"{g}/{p}")
                                     if isinstance(o, h5py.Dataset) else None)
            if not paths:
                out.append(f"{name}: no datasets under {', '.join(groups)}")
            for p in paths:
                if p not in fb:
                    out.append(f"{name} /{p}: missing from {dir_b}")
                    continue
                a, b = fa[p][()], fb[p][()]
                if a.shape != b.shape or a.dtype != b.dtype:
                    out.append(f"{name} /{p}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
                elif a.tobytes() != b.tobytes():
                    n = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
                    out.append(f"{name} /{p}: {n} bytes differ")
    return len(names), out
