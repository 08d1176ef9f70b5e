"""What `moet bench` writes: one row per measurement, printed as it lands; DIR/bench.json
rewritten after every row (an interrupted run keeps what it measured); DIR/bench.md, one table
per scenario with the device, date and commit on every row (ready to paste into docs/perf.md);
DIR/*.png plots when matplotlib is installed (the `bench` extra; imported only here, only then)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from moet.errors import ConfigError

SCENARIOS = ("decode", "prefill", "residency", "serve")
PLOTS_NEED = "plots need matplotlib: pip install 'moet[bench]' (bench.json and bench.md are written)"
MD_COLUMNS = ("device", "date", "commit", "shape", "config", "tok/s", "GB/s", "% of roofline", "peer ratio", "notes")


def git_commit() -> str | None:
    """The source tree's commit (`+dirty` with uncommitted changes to tracked files), or None
    outside a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=30)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


def out_dir(path: str) -> Path:
    """--out, created and checked writable up front (one clear line, not a traceback at the end)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".moet-bench-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {path}: not a writable directory ({exc.strerror or exc})") from None
    return p


def _num(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


class Report:
    """The run's rows and facts; save() after each measurement."""

    def __init__(self, out: Path, device: torch.device, args: dict):
        self.out = out
        self.device = device
        self.info = {"device": device_name(device), "device_type": device.type,
                     "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": git_commit(),
                     "torch": torch.__version__, "args": args}
        if device.type == "cuda":
            try:
                import triton
                self.info["triton"] = triton.__version__
            except ImportError:
                pass
        self.rows: list[dict] = []
        self.sections: dict = {}           # per scenario: correctness, engine facts, errors
        self.roofline: dict | None = None

    def add(self, row: dict) -> dict:
        """A measurement: scenario, shape, system, config, tok_s, and where they apply batch,
        tokens, gb_s, pct_roofline, peer_ratio, notes, details."""
        self.rows.append(row)
        print(self.line(row), flush=True)
        self.save()
        return row

    def note(self, scenario: str, key: str, value) -> None:
        self.sections.setdefault(scenario, {})[key] = value
        self.save()

    def line(self, r: dict) -> str:
        parts = [f"[{r['scenario']}]", r["shape"], r["config"], f"{_num(r.get('tok_s'))} tok/s"]
        if r.get("gb_s") is not None:
            parts.append(f"{_num(r['gb_s'])} GB/s")
        if r.get("pct_roofline") is not None:
            parts.append(f"{r['pct_roofline']:.0f}% of roofline")
        if r.get("peer_ratio") is not None:
            parts.append(f"{r['peer_ratio']:.2f}x the peer")
        if r.get("notes"):
            parts.append(r["notes"])
        return "  ".join(parts)

    def save(self) -> None:
        data = {"info": self.info, "roofline": self.roofline, "rows": self.rows, "sections": self.sections}
        tmp = self.out / "bench.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.out / "bench.json")
        (self.out / "bench.md").write_text(self.markdown())

    def markdown(self) -> str:
        i = self.info
        head = [f"# moet bench: {i['device']}, {i['date_utc']} UTC, commit {i['commit'] or 'n/a'}", "",
                f"torch {i['torch']}" + (f", triton {i['triton']}" if i.get("triton") else "") + "."]
        if self.roofline:
            head[-1] += (f" Roofline: {self.roofline['what']}, {_num(self.roofline['GBps'])} GB/s, measured in "
                         f"this run; % of roofline = GB/s / that.")
        else:
            head[-1] += " Roofline: not measured (no decode in this run)."
        lines = head
        for sc in SCENARIOS:
            rows = [r for r in self.rows if r["scenario"] == sc]
            if not rows:
                continue
            lines += ["", f"## {sc}", "", "| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
            for r in rows:
                ratio = f"{r['peer_ratio']:.2f}x" if r.get("peer_ratio") is not None else "-"
                pct = f"{r['pct_roofline']:.0f}%" if r.get("pct_roofline") is not None else "-"
                cells = [i["device"], i["date_utc"], i["commit"] or "n/a", r["shape"], r["config"],
                         _num(r.get("tok_s")), _num(r.get("gb_s")), pct, ratio, r.get("notes") or ""]
                lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
        return "\n".join(lines) + "\n"

    def plots(self) -> list[Path]:
        """PNG plots of what ran; [] (after saying why, once) without matplotlib."""
        try:
            import matplotlib
        except ImportError:
            print(PLOTS_NEED, flush=True)
            return []
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        made = []
        specs = [("decode", "batch", "tok_s", "decode tok/s (all sequences)", "decode_tok_s.png"),
                 ("decode", "batch", "pct_roofline", "% of roofline", "decode_roofline.png"),
                 ("prefill", "tokens", "tok_s", "prefill tok/s", "prefill_tok_s.png"),
                 ("residency", "batch", "tok_s", "decode tok/s", "residency_tok_s.png")]
        for scenario, x, y, ylabel, name in specs:
            series: dict[str, list[tuple[float, float]]] = {}
            for r in self.rows:
                if r["scenario"] == scenario and r.get(x) is not None and r.get(y) is not None:
                    series.setdefault(r.get("series") or f"{r['shape']} {r['system']}", []).append((r[x], r[y]))
            if not series:
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for label, pts in series.items():
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(x)
            ax.set_ylabel(ylabel)
            ax.set_title(f"moet bench {scenario}: {self.info['device']}", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(self.out / name, dpi=110)
            plt.close(fig)
            made.append(self.out / name)
        return made
