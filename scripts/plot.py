#!/usr/bin/env python3
"""Draws a run directory: loss and validation-loss curves from metrics.jsonl (loss.png, loss.svg);
for a mixture of experts the expert load over steps (experts.png, experts.svg: each MoE layer's
busiest expert over the mean, and the slots the capacity dropped when any did); and, when the run
was traced (--trace), the pipeline timeline of its last step from trace.json
(timeline.png, timeline.svg): one row per rank, forward / backward / weight-gradient spans per
micro-batch and chunk, communication in grey, idle time blank.

Usage: scripts/plot.sh RUN_DIR [OUT_DIR]   (installs Debian's python3-matplotlib if missing)"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, out, name):
    """Writes `fig` as out/NAME.png and out/NAME.svg; returns the paths."""
    written = []
    for ext in ("png", "svg"):
        path = os.path.join(out, f"{name}.{ext}")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        written.append(path)
    return written


def plot_loss(run, out):
    steps, loss, vsteps, vloss = [], [], [], []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "loss" not in m:  # snapshot lines
                continue
            steps.append(m["step"])
            loss.append(m["loss"])
            if m.get("val_loss") is not None:
                vsteps.append(m["step"])
                vloss.append(m["val_loss"])
    if not steps:
        sys.exit(f"plot: {run}/metrics.jsonl has no training steps")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, loss, label="training loss", linewidth=1)
    if vsteps:
        ax.plot(vsteps, vloss, "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(os.path.basename(os.path.normpath(run)))
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, out, "loss")


def plot_experts(run, out):
    """A mixture of experts' load per layer over steps (docs/metrics.md); nothing for a dense run."""
    prefix = "expert_imbalance_layer_"
    steps, layers, dropped = [], {}, []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "expert_imbalance" not in m:
                continue
            steps.append(m["step"])
            dropped.append(m.get("dropped_slots") or 0)
            for k, v in m.items():
                if k.startswith(prefix):
                    layers.setdefault(int(k[len(prefix):]), []).append((m["step"], v))
    if not steps:
        return []
    show_drops = any(d > 0 for d in dropped)
    fig, axes = plt.subplots(2 if show_drops else 1, 1, figsize=(8, 6.5 if show_drops else 4.5),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    for layer in sorted(layers):
        xs, ys = zip(*layers[layer])
        ax.plot(xs, ys, label=f"layer {layer}", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel("expert imbalance (busiest / mean)")
    ax.set_title(os.path.basename(os.path.normpath(run)) + ": expert load")
    ax.grid(alpha=0.3)
    if layers:
        ax.legend(fontsize="small")
    if show_drops:
        axes[1][0].plot(steps, dropped, linewidth=1, color="#c44e52")
        axes[1][0].set_ylabel("dropped slots (worst layer)")
        axes[1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    return save(fig, out, "experts")


COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "backward (input grads)": "#dd8452",
           "backward (weight grads)": "#55a868"}


def plot_timeline(run, out):
    path = os.path.join(run, "trace.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    # The last training step of every rank without a validation pass in it: spans inside it.
    def inside(e, step):
        return e["pid"] == step["pid"] and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]

    validations = [e for e in spans if "validation" in e["name"]]
    last_step = {}
    for e in spans:
        if e["name"] != "step" or any(inside(v, e) for v in validations):
            continue
        if e["pid"] not in last_step or e["ts"] > last_step[e["pid"]]["ts"]:
            last_step[e["pid"]] = e
    if not last_step:
        return []
    t0 = min(s["ts"] for s in last_step.values())
    ranks = sorted(last_step)
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(ranks) + 1.5))
    for row, pid in enumerate(ranks):
        step = last_step[pid]
        mine = [e for e in spans if e is not step and e["name"] != "step" and inside(e, step)]
        mine.sort(key=lambda e: e.get("cat") != "comm")  # communication first, compute on top
        for e in mine:
            colour = COLOURS.get(e["name"], "#b0b0b0" if e.get("cat") == "comm" else "#8172b3")
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (row - 0.4, 0.8),
                           facecolors=colour, edgecolor="none")
            args = e.get("args", {})
            if "mb" in args and e["dur"] / 1e3 > 0.02 * step["dur"] / 1e3:
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, row, str(args["mb"]), ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([names.get(p, f"rank {p}") for p in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the start of the last step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               (COLOURS["forward"], COLOURS["backward"], COLOURS["backward (weight grads)"],
                "#b0b0b0", "#8172b3")]
    ax.legend(handles, ["forward", "backward (input)", "weight grads (W)", "communication",
                        "other"], loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5,
              fontsize=8)
    ax.set_title("pipeline timeline, last step (numbers: micro-batch)")
    return save(fig, out, "timeline")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    run = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else run
    os.makedirs(out, exist_ok=True)
    for p in plot_loss(run, out) + plot_experts(run, out) + plot_timeline(run, out):
        print(p)


if __name__ == "__main__":
    main()
