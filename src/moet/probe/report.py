"""`moet probe`'s results as a markdown table (one row per expert format / gate threshold), a
plot of accuracy against the confidence gate's fire rate (the trade-off a user picks --gate-tau
from), and the needle probe's pass rate by depth x prompt length (a table per variant and a heat
map). Input: the dict `moet probe --json` writes ({"formats": {variant: run_all's output}})."""
from __future__ import annotations

import math

from moet.probe.engine import GATE_PREFIX

# (column title, probe, key) of the table, in order
COLUMNS = (
    ("facts", "facts", "accuracy"),
    ("arithmetic", "arithmetic", "accuracy"),
    ("needle <= 2K", "needle", "pass_rate_upto_2048"),
    ("right function", "tools", "call_right_function"),
    ("code top-1 vs bf16", "code", "top1_vs_bf16"),
    ("code KL vs bf16", "code", "kl_vs_bf16"),
)
# probes whose fire rate the table shows (generation probes: teacher-forced scoring never fires)
FIRE_COLUMNS = ("facts", "arithmetic", "tools")


def _cell(value, pct: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{100 * value:.1f}%" if pct else f"{value:.4g}"


def _label(variant: str) -> str:
    return f"W2 + gate, tau {variant[len(GATE_PREFIX):]}" if variant.startswith(GATE_PREFIX) else \
        {"bf16": "BF16", "nvfp4": "NVFP4 (FP4)", "w2": "W2"}.get(variant, variant)


def markdown_table(results: dict) -> str:
    """One row per variant: each probe's headline number and, for gated rows, the fire rate and
    FP4 rows recomputed per generated token of the generation probes."""
    fmts = results.get("formats", {})
    shown = [c for c in COLUMNS if any(c[2] in (r.get(c[1]) or {}) for r in fmts.values())]
    fires = [p for p in FIRE_COLUMNS if any("gate_fire_rate" in (r.get(p) or {}) for r in fmts.values())]
    mtp = [p for p in FIRE_COLUMNS if any("mtp_tokens_per_step" in (r.get(p) or {}) for r in fmts.values())]
    head = ["experts"] + [c[0] for c in shown] + [f"fire, {p}" for p in fires] + \
        (["FP4 rows / token, arithmetic"] if "arithmetic" in fires else []) + \
        [f"MTP tokens / step, {p}" for p in mtp]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, r in fmts.items():
        row = [_label(variant)]
        for _, probe, key in shown:
            row.append(_cell((r.get(probe) or {}).get(key), not key.startswith("kl")))
        for p in fires:
            row.append(_cell((r.get(p) or {}).get("gate_fire_rate"), True))
        if "arithmetic" in fires:
            row.append(_cell((r.get("arithmetic") or {}).get("gate_rows_per_token"), False))
        for p in mtp:
            row.append(_cell((r.get(p) or {}).get("mtp_tokens_per_step"), False))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n" + needle_tables(results)


def _needle_grids(results: dict) -> dict[str, tuple[list[int], list[float], dict]]:
    """variant -> (lengths, depths, {length str: {depth str: pass rate}}) of the variants whose
    needle probe ran over more than one cell."""
    out = {}
    for variant, r in results.get("formats", {}).items():
        grid = (r.get("needle") or {}).get("by_length_depth") or {}
        lengths = sorted(int(k) for k in grid)
        depths = sorted({float(d) for row in grid.values() for d in row})
        if len(lengths) * len(depths) > 1:
            out[variant] = (lengths, depths, grid)
    return out


def needle_tables(results: dict) -> str:
    """Per variant, the needle pass rate by depth (rows) x prompt length in tokens (columns)."""
    text = ""
    for variant, (lengths, depths, grid) in _needle_grids(results).items():
        text += f"\nneedle pass rate, {_label(variant)}, KV {results.get('kv_cache_dtype', 'auto')}\n\n"
        text += "| depth | " + " | ".join(f"{n:,}" for n in lengths) + " |\n|" + "---|" * (len(lengths) + 1) + "\n"
        for d in depths:
            cells = [_cell(grid.get(str(n), {}).get(str(d)), True) for n in lengths]
            text += f"| {d:g} | " + " | ".join(cells) + " |\n"
    return text


def plot_needle_map(results: dict, path: str) -> None:
    """Heat map of the needle pass rate, depth x prompt length, one panel per variant."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from moet.errors import ConfigError
        raise ConfigError("--needle-map needs matplotlib: pip install 'moet[bench]'") from None
    grids = _needle_grids(results)
    if not grids:
        from moet.errors import ConfigError
        raise ConfigError("--needle-map: no needle grid to draw (the needle probe ran over one length and depth, "
                          "or not at all; see --needle-lengths / --needle-depths)")
    cols = max(len(g[0]) for g in grids.values())
    fig, axes = plt.subplots(1, len(grids), figsize=(1.5 + (1.0 + 0.8 * cols) * len(grids),
                                                     1.8 + 0.45 * max(len(g[1]) for g in grids.values())),
                             squeeze=False, constrained_layout=True)
    for k, (ax, (variant, (lengths, depths, grid))) in enumerate(zip(axes[0], grids.items())):
        z = [[grid.get(str(n), {}).get(str(d), float("nan")) for n in lengths] for d in depths]
        im = ax.imshow(z, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(z):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("prompt tokens")
        if k == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{_label(variant)}, KV {results.get('kv_cache_dtype', 'auto')}", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label="pass rate")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tradeoff(results: dict, path: str) -> None:
    """Accuracy against fire rate, one panel per generation probe that ran: the gated variants as a
    curve labelled with their tau, bare W2 at fire 0 and NVFP4 at fire 1 as the two ends."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from moet.errors import ConfigError
        raise ConfigError("--plot needs matplotlib: pip install 'moet[bench]'") from None
    fmts = results.get("formats", {})
    panels = [(p, k) for p, k in (("arithmetic", "accuracy"), ("facts", "accuracy"))
              if any(k in (r.get(p) or {}) for r in fmts.values())]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.5 * max(1, len(panels)), 4), squeeze=False)
    for ax, (probe, key) in zip(axes[0], panels):
        pts = sorted((r[probe]["gate_fire_rate"], r[probe][key], v[len(GATE_PREFIX):])
                     for v, r in fmts.items() if v.startswith(GATE_PREFIX) and key in (r.get(probe) or {}))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="W2 + gate")
            for x, y, tau in pts:
                ax.annotate(f"tau {tau}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
        for v, style in (("w2", "s"), ("nvfp4", "^"), ("bf16", "D")):
            r = fmts.get(v, {}).get(probe) or {}
            if key in r:
                ax.plot([0.0 if v == "w2" else 1.0], [r[key]], style, label=_label(v))
        ax.set_xlabel("gate fire rate (share of decode steps repaired)")
        ax.set_ylabel(f"{probe} {key}")
        ax.set_xlim(-0.03, 1.03)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(probe)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
