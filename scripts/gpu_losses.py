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
