"""Plots of `python -m bench sweep` results: Figure 6 of the bifurcated-attention paper, redrawn.

One column per run (a JSON from `python -m bench sweep`, typically one per dtype):
  top:    per-step decode latency (ms) against context length, one colour per n;
          solid = with bifurcation (forklm-bifurcated), dashed = without (forklm-standard);
  bottom: forklm-auto (solid) against transformers (dotted) and the docs/design.md floor (thin);
          with `--llama-cpp`, llama.cpp dashed (squares: flash attention off, triangles: on).
A run without forklm-standard / forklm-bifurcated rows (e.g. `--paths auto --llama-cpp`) gets generated
tokens/s against n in the top panel instead, one colour per context length, styles as below.

Run: `python -m bench.plot bench/results/sweep_cpu_float32.json bench/results/sweep_cpu_bfloat16.json
--out bench/results/figure6_cpu.png`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _series(points: list[dict], impl: str, n: int, key: str = "step_ms_median") -> tuple[list[int], list[float]]:
    """(context lengths, values) of one implementation at one n, skipped points left out."""
    rows = sorted((p for p in points if p["impl"] == impl and p["n"] == n and p.get(key) and not p.get("skipped")),
                  key=lambda p: p["m_c"])
    return [p["m_c"] for p in rows], [p[key] for p in rows]


def _floor_series(points: list[dict], n: int) -> tuple[list[int], list[float]]:
    by_mc = {p["m_c"]: p["floor_ms"] for p in points if p["n"] == n and p.get("floor_ms")}
    xs = sorted(by_mc)
    return xs, [by_mc[x] for x in xs]


# The bottom panel's implementations: (line style, marker, legend label).
PEER_STYLES = {"forklm-auto": ("-", "o", "forklm auto"), "transformers": (":", "o", "transformers"),
               "llama.cpp": ("--", "s", "llama.cpp"), "llama.cpp-fa": ("--", "^", "llama.cpp flash attn")}


def _plot_tokens_per_s(ax, points: list[dict], plt) -> None:
    """Generated tokens/s against n, one colour per context length, one style per implementation."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullLocator

    contexts = sorted({p["m_c"] for p in points})
    colours = {m: plt.cm.plasma(i / max(1, len(contexts) - 1) * 0.85) for i, m in enumerate(contexts)}
    impls = [i for i in PEER_STYLES if any(p["impl"] == i for p in points)]
    for impl in impls:
        style, marker, _ = PEER_STYLES[impl]
        for m_c in contexts:
            rows = sorted((p for p in points if p["impl"] == impl and p["m_c"] == m_c and p.get("tokens_per_s")
                           and not p.get("skipped")), key=lambda p: p["n"])
            if rows:
                ax.plot([p["n"] for p in rows], [p["tokens_per_s"] for p in rows], style, color=colours[m_c],
                        marker=marker, markersize=3.5, linewidth=1.6)
    ns = sorted({p["n"] for p in points})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("samples n")
    ax.set_ylabel("generated tokens/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(handles=[Line2D([], [], color=colours[m], label=f"m_c = {m}") for m in contexts]
              + [Line2D([], [], color="k", ls=PEER_STYLES[i][0], marker=PEER_STYLES[i][1], label=PEER_STYLES[i][2])
                 for i in impls], fontsize=8)


def _title(meta: dict) -> str:
    model = Path(str(meta.get("model", "?"))).name
    return f"{model}\n{meta.get('dtype', '?')} on {meta.get('device', '?')}, {meta.get('new_tokens', '?')} new tokens"


def _style_axis(ax, contexts: list[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if contexts:
        ax.set_xticks(contexts)
        ax.set_xticklabels([str(c) for c in contexts])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("context length m_c (tokens)")
    ax.set_ylabel("per-step latency (ms)")
    ax.grid(True, which="both", alpha=0.3)


def plot_sweeps(docs: list[dict], path: str | Path) -> Path:
    """Draws every run's two panels into one PNG at `path`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, len(docs), figsize=(6.2 * len(docs), 9.5), squeeze=False)
    for col, doc in enumerate(docs):
        points, meta = doc["points"], doc.get("meta", {})
        ns = sorted({p["n"] for p in points})
        contexts = sorted({p["m_c"] for p in points})
        colours = {n: plt.cm.viridis(i / max(1, len(ns) - 1) * 0.9) for i, n in enumerate(ns)}
        top, bottom = axes[0][col], axes[1][col]
        for n in ns:
            c = colours[n]
            lines = [(top, "forklm-bifurcated", "-", "o"), (top, "forklm-standard", "--", "o")]
            lines += [(bottom, impl, style, marker) for impl, (style, marker, _) in PEER_STYLES.items()]
            for ax, impl, style, marker in lines:
                xs, ys = _series(points, impl, n)
                if xs:
                    ax.plot(xs, ys, style, color=c, marker=marker, markersize=3.5, linewidth=1.6)
            xs, ys = _floor_series(points, n)
            if xs:
                bottom.plot(xs, ys, "-.", color=c, linewidth=0.8, alpha=0.6)
        impls = {p["impl"] for p in points}
        if impls & {"forklm-bifurcated", "forklm-standard"}:
            top.set_title("with (solid) / without (dashed) bifurcation\n" + _title(meta), fontsize=9)
            _style_axis(top, contexts)
            top.legend(handles=[Line2D([], [], color=colours[n], marker="o", markersize=3.5, label=f"n = {n}")
                                for n in ns] + [Line2D([], [], color="k", ls="-", label="bifurcated"),
                                                Line2D([], [], color="k", ls="--", label="standard")], fontsize=8)
        else:  # no bifurcation rows: the top panel shows generated tokens/s against n instead
            top.set_title("generated tokens/s against n\n" + _title(meta), fontsize=9)
            _plot_tokens_per_s(top, points, plt)
        peers = [i for i in PEER_STYLES if i in impls]
        bottom.set_title("per-step latency: " + ", ".join(PEER_STYLES[i][2] for i in peers) + ", floor", fontsize=9)
        _style_axis(bottom, contexts)
        bottom.legend(handles=[Line2D([], [], color=colours[n], marker="o", markersize=3.5, label=f"n = {n}")
                               for n in ns]
                      + [Line2D([], [], color="k", ls=PEER_STYLES[i][0], marker=PEER_STYLES[i][1],
                                label=PEER_STYLES[i][2]) for i in peers]
                      + [Line2D([], [], color="k", ls="-.", lw=0.8, label="floor")], fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="JSON files written by `python -m bench sweep` (one panel column each)")
    ap.add_argument("--out", required=True, help="PNG path")
    a = ap.parse_args()
    docs = [json.loads(Path(p).read_text()) for p in a.results]
    print(plot_sweeps(docs, a.out))


if __name__ == "__main__":
    main()
