"""After a GPU training run: unpack the returned checkpoint parts, probe the checkpoint on CPU per
expert format, merge the results into the run's summary, render MODEL_CARD.md, optionally ship.

    python -m tools.train_tiny.ingest RETURNED_DIR [--runs-dir tools/train_tiny/runs/full-v3]
        [--experts nvfp4 --experts w2] [--budget full] [--baseline tools/train_tiny/runs/full-v5/summary_shipped.json]
        [--note "markdown paragraph" ...] [--ship]

RETURNED_DIR holds what the device run wrote to $OUT: ckpt.tar.part-NN, summary.json and
run_log.jsonl. Steps (each prints as it goes; a re-run skips finished probes, whose results
are kept in RUNS_DIR/cpu_probes.json):
1. `cat ckpt.tar.part-* | tar x` into --stage (default $TMPDIR/moet-tiny-<recipe>) and check
   the size limits (every shard <= 15 MiB, all files <= 48 MiB) and that the files the card
   names are there;
2. the probes of `moet probe CKPT --experts FMT --budget full --device cpu` for each format,
   in-process (float32; ~10 minutes per format on 2 idle CPU cores);
3. RUNS_DIR/summary.json (the run's, untouched), run_log.jsonl, summary_shipped.json (= the
   run's + the CPU rows + probe_sources + addenda: where the rows come from, a table against the
   baseline, your --note paragraphs) and STAGE/moet-tiny/MODEL_CARD.md;
4. --ship: replace the checkpoint files in src/moet/assets/moet-tiny/ (stale shards removed).
"""
from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

SHARD_LIMIT = 15 * 2**20
TOTAL_LIMIT = 48 * 2**20
REQUIRED = ("config.json", "generation_config.json", "hf_quant_config.json", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
ASSET = Path(__file__).resolve().parents[2] / "src" / "moet" / "assets" / "moet-tiny"
# (card label, probe, key) of the numbers compared against the baseline
HEADLINE = (("code loss", "code", "loss"), ("facts", "facts", "accuracy"), ("arithmetic", "arithmetic", "accuracy"),
            ("needle <= 2K", "needle", "pass_rate_upto_2048"), ("needle all", "needle", "pass_rate"),
            ("tool markup valid", "tools", "call_valid"), ("right function", "tools", "call_right_function"),
            ("right args", "tools", "call_right_arguments"),
            ("declines w/o tool", "tools", "declines_when_no_tool_fits"),
            ("answers from result", "tools", "answers_from_result"))


def unpack(returned: Path, stage: Path) -> Path:
    parts = sorted(returned.glob("ckpt.tar.part-*"))
    if not parts:
        raise SystemExit(f"{returned}: no ckpt.tar.part-* files (the run packs them with --pack $OUT)")
    data = b"".join(p.read_bytes() for p in parts)
    stage.mkdir(parents=True, exist_ok=True)
    for old in stage.iterdir():  # a previous unpack: one checkpoint directory, nothing else
        if not (old.is_dir() and (old / "config.json").exists()):
            raise SystemExit(f"{stage} holds {old.name}, not a previous unpack: pass an empty --stage")
        shutil.rmtree(old)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        names = tf.getnames()
        if any(n.startswith("/") or ".." in Path(n).parts for n in names):
            raise SystemExit(f"refusing to unpack unsafe paths: {names}")
        tf.extractall(stage, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    dirs = {n.split("/")[0] for n in names}
    if len(dirs) != 1:
        raise SystemExit(f"expected one checkpoint directory in the tar, got {sorted(dirs)}")
    ckpt = stage / dirs.pop()
    check_limits(ckpt)
    return ckpt


def check_limits(ckpt: Path) -> dict[str, int]:
    sizes = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.is_file()}
    missing = [f for f in REQUIRED if f not in sizes]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    missing += [s for s in shards if s not in sizes]
    big = {s: sizes[s] for s in shards if s in sizes and sizes[s] > SHARD_LIMIT}
    total = sum(v for k, v in sizes.items() if k != "MODEL_CARD.md")
    if missing or big or total > TOTAL_LIMIT:
        raise SystemExit(f"{ckpt}: missing {missing}, shards over 15 MiB {big}, total {total / 2**20:.1f} MiB "
                         f"(limit 48)")
    print(f"checkpoint {ckpt}: {len(shards)} shards, {total / 2**20:.1f} MiB", flush=True)
    return sizes


def cpu_probes(ckpt: Path, formats: list[str], budget: str, cache: Path) -> dict[str, dict]:
    from moet.probe.engine import open_engine
    from moet.probe.run import run_all
    done = json.loads(cache.read_text()) if cache.exists() else {}
    for fmt in formats:
        if fmt in done and done[fmt].get("budget") == budget:
            print(f"{fmt}: cached in {cache}", flush=True)
            continue
        m = open_engine(ckpt, fmt, "cpu")            # what `moet probe` runs: moet's engine
        t = time.time()
        try:
            done[fmt] = run_all(m, budget, log=lambda rec: print(json.dumps(rec), flush=True))
        finally:
            m.close()
        done[fmt]["date_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        cache.write_text(json.dumps(done, indent=2) + "\n")
        print(f"{fmt}: probes took {time.time() - t:.0f} s", flush=True)
        del m
    return {f: done[f] for f in formats}


def _num(p: dict, probe: str, key: str):
    v = p.get(probe, {}).get(key)
    return v if isinstance(v, (int, float)) else None


def _fmt(label: str, v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4f}" if label == "code loss" else f"{100 * v:.1f}%"


def comparison(new: dict, base: dict, fmt: str) -> str:
    """Markdown table: the baseline's and this run's headline numbers for one expert format."""
    a, b = base["probes"].get(fmt, {}), new["probes"].get(fmt, {})
    head = "| " + " | ".join(["recipe"] + [h[0] for h in HEADLINE]) + " |\n|---|" + "---|" * len(HEADLINE)
    rows = [f"| {s['recipe']['name']} | " + " | ".join(_fmt(h[0], _num(p, h[1], h[2])) for h in HEADLINE) + " |"
            for s, p in ((base, a), (new, b))]
    return "\n".join([head] + rows)


def merge(summary: dict, cpu: dict[str, dict], budget: str, base: dict | None, notes: list[str]) -> dict:
    s = json.loads(json.dumps(summary))
    run_formats = [f for f, p in s["probes"].items() if any(isinstance(v, dict) and "skipped" not in v
                                                           for v in p.values())]
    run_device = s["env"].get("device_name")
    sources = {f: f"training run on the {run_device} (bf16, transformers' forward), before the run's probe deadline: "
                  + ", ".join(k for k, v in s["probes"][f].items() if isinstance(v, dict) and "skipped" not in v)
               for f in run_formats if f not in cpu}
    probes = {f: s["probes"][f] for f in run_formats if f not in cpu}
    for fmt, res in cpu.items():
        probes[fmt] = res
        sources[fmt] = f"moet probe --experts {fmt} --budget {budget} --device cpu (float32), " \
                       f"{res.get('date_utc', '')[:10]}, on the exported files"
    s["probes"], s["probe_sources"] = probes, sources
    addenda = ["**Where the rows come from.** " + "; ".join(f"{f}: {src}" for f, src in sources.items()) + "."]
    if base is not None:
        for fmt in cpu:
            if fmt in base["probes"]:
                addenda.append(f"**{base['recipe']['name']} -> {s['recipe']['name']}, {fmt} experts** (same probes, "
                               f"same grader):\n\n{comparison(s, base, fmt)}")
    s["addenda"] = addenda + list(notes)
    s.pop("corrections", None)
    return s


def ship(ckpt: Path, dest: Path = ASSET) -> None:
    """Replace the shipped checkpoint by `ckpt` (every file; shards the new index no longer names go)."""
    check_limits(ckpt)
    for p in dest.iterdir():
        if p.is_file() and (p.name.endswith(".safetensors") or p.name in REQUIRED):
            p.unlink()
    for p in ckpt.iterdir():
        shutil.copy2(p, dest / p.name)
    print(f"shipped {ckpt} -> {dest}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny.ingest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("returned", type=Path,
                    help="the device run's $OUT files (ckpt.tar.part-*, summary.json, run_log.jsonl)")
    ap.add_argument("--runs-dir", type=Path, default=None, help="default: tools/train_tiny/runs/<recipe>")
    ap.add_argument("--stage", type=Path, default=None,
                    help="where the checkpoint is unpacked (default: $TMPDIR/moet-tiny-<recipe>; not in the repo)")
    ap.add_argument("--experts", action="append", choices=["nvfp4", "w2"],
                    help="formats probed on CPU (default: both; the BF16 row can only come from the run, "
                         "--experts bf16 on NVFP4 files equals nvfp4)")
    ap.add_argument("--budget", default="full", choices=["tiny", "quick", "full"])
    ap.add_argument("--baseline", type=Path, default=Path(__file__).parent / "runs" / "full-v5" / "summary_shipped.json",
                    help="summary to compare against (default: the shipped model's, full-v5; v2's is "
                         "runs/summary_shipped.json)")
    ap.add_argument("--note", action="append", default=[], help="a markdown paragraph for the card's 'After the run'")
    ap.add_argument("--ship", action="store_true", help="replace src/moet/assets/moet-tiny with this checkpoint")
    args = ap.parse_args(argv)

    summary = json.loads((args.returned / "summary.json").read_text())
    runs = args.runs_dir or Path(__file__).parent / "runs" / summary["recipe"]["name"]
    runs.mkdir(parents=True, exist_ok=True)
    ckpt = unpack(args.returned, args.stage or Path(tempfile.gettempdir()) / f"moet-tiny-{summary['recipe']['name']}")
    shutil.copy2(args.returned / "summary.json", runs / "summary.json")
    if (args.returned / "run_log.jsonl").exists():
        shutil.copy2(args.returned / "run_log.jsonl", runs / "run_log.jsonl")
    cpu = cpu_probes(ckpt, args.experts or ["nvfp4", "w2"], args.budget, runs / "cpu_probes.json")
    base = json.loads(args.baseline.read_text()) if args.baseline and args.baseline.exists() else None
    merged = merge(summary, cpu, args.budget, base, args.note)
    (runs / "summary_shipped.json").write_text(json.dumps(merged, indent=2, default=str) + "\n")
    from tools.train_tiny.card import write_card
    write_card(ckpt / "MODEL_CARD.md", merged)
    print(f"wrote {runs / 'summary_shipped.json'} and {ckpt / 'MODEL_CARD.md'}", flush=True)
    if base is not None:
        for fmt in cpu:
            if fmt in base["probes"]:
                print(f"\n{fmt}:\n{comparison(merged, base, fmt)}", flush=True)
    if args.ship:
        ship(ckpt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
