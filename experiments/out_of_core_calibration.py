"""Calibrate and prune a synthetic checkpoint larger than half this machine's memory, under a host budget.

    python -m experiments.out_of_core_calibration --work /tmp/ooc --out docs/results/out-of-core

1. Builds (once) a `cpu`-preset Qwen3-MoE checkpoint of `--layers` layers in bf16 (seed 0) and a small one of
   `--small-layers` layers.
2. `slimwise calibrate --phase prompt --max-memory cpu=BUDGET` on the large checkpoint for each budget: the
   layer-streamed pass. Peak RSS and wall time from `/usr/bin/time -v`; bytes read from storage from
   /proc/self/io (`read_bytes`) with the page cache dropped before each run (where the kernel allows it).
3. The statistics of the budgets must be identical, field for field.
4. `slimwise prune` (streamed export) of the large checkpoint with the REAP 50% plan of those statistics.
5. On the small checkpoint, which fits: the in-memory pass (no --max-memory) against the streamed pass.

Writes `out-of-core-calibration.json` and prints a markdown table. Prompts: `--prompts` rows of
`--prompt-len` random token ids (seed 0), written as the words of the synthetic checkpoint's word-level
tokenizer.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: runs the CLI in this process, samples its memory every 50 ms (anonymous and file-backed resident pages
#: apart: a memory-mapped checkpoint's pages count in RSS but the kernel can drop them), then reports the
#: peaks and the process's I/O counters on stderr
RUNNER = """
import json, sys, threading, time
from slimwise.cli import main
peak = {}
def sample():
    while True:
        for line in open('/proc/self/status'):
            key, _, value = line.partition(':')
            if key in ('VmRSS', 'RssAnon', 'RssFile'):
                peak[key] = max(peak.get(key, 0), int(value.split()[0]))
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
rc = main(sys.argv[1:])
io = dict(line.split(': ') for line in open('/proc/self/io').read().splitlines())
print('IO ' + json.dumps(io), file=sys.stderr)
print('PEAK ' + json.dumps(peak), file=sys.stderr)
sys.exit(rc)
"""


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def timed(argv: list[str], log: Path, cgroup: Path | None = None) -> dict:
    """`slimwise ARGV` under /usr/bin/time -v, cold page cache: peak RSS, wall, bytes read. With `cgroup` (a
    cgroup-v1 memory group), inside it."""
    cold = drop_caches()
    t0 = time.perf_counter()
    command = ["/usr/bin/time", "-v", sys.executable, "-c", RUNNER, *argv]
    if cgroup is not None:
        command = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *command]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): slimwise {' '.join(argv)}; log {log}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    io = json.loads(re.search(r"^IO (.*)$", proc.stderr, re.MULTILINE).group(1))
    said = [line for line in proc.stderr.splitlines() if line.startswith(("calibrate:", "wrote", "prune"))]
    peak = json.loads(re.search(r"^PEAK (.*)$", proc.stderr, re.MULTILINE).group(1))
    return {"argv": argv, "peak_rss_kb": rss, "peak_rss_gib": round(rss / 2**20, 2), "wall_s": round(wall, 1),
            "peak_anon_gib": round(peak["RssAnon"] / 2**20, 2),
            "peak_file_gib": round(peak["RssFile"] / 2**20, 2),
            "read_bytes": int(io["read_bytes"]), "read_gb": round(int(io["read_bytes"]) / 1e9, 2),
            "written_gb": round(int(io["write_bytes"]) / 1e9, 2), "cold_cache": cold,
            "said": said + [line for line in proc.stdout.splitlines() if line.startswith("wrote")]}


def same_stats(a_path: Path, b_path: Path) -> dict:
    from slimwise.stats import ExpertStats

    a, b = ExpertStats.load(a_path), ExpertStats.load(b_path)
    fields = ("tokens", "count", "gate_sum", "norm_sum", "norm_sq_sum", "gate_norm_sum")
    out = {name: bool(torch.equal(getattr(a, name), getattr(b, name))) for name in fields}
    out["max_rel"] = max(float((getattr(a, n) - getattr(b, n)).abs().sum() / getattr(a, n).abs().sum()
                               .clamp_min(1e-30)) for n in fields)
    return out


def in_cgroup(big: Path, common: list[str], budget: str, limit: str, work: Path) -> dict:
    """The first budget's calibration again, inside a cgroup-v1 memory group of `limit` bytes: the kernel
    charges the group's page cache too and reclaims it (or kills the process) at the limit."""
    group = Path("/sys/fs/cgroup/memory/slimwise-out-of-core")
    group.mkdir(exist_ok=True)
    try:
        (group / "memory.limit_in_bytes").write_text(limit)
        stats = work / "stats-cgroup.safetensors"
        run = timed(["calibrate", str(big), *common, "--max-memory", f"cpu={budget}", "--out", str(stats)],
                    work / "calibrate_cgroup.log", cgroup=group)
        run |= {"limit_bytes": int((group / "memory.limit_in_bytes").read_text()),
                "max_usage_bytes": int((group / "memory.max_usage_in_bytes").read_text()),
                "failcnt": int((group / "memory.failcnt").read_text())}
        run["same_stats_as_without"] = same_stats(work / f"stats-{budget}.safetensors", stats)
        return run
    finally:
        group.rmdir()


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/ooc")
    parser.add_argument("--out", default="docs/results/out-of-core")
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--small-layers", type=int, default=6)
    parser.add_argument("--budgets", default="3GB,6GB")
    parser.add_argument("--small-budget", default="0.3GB")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--cgroup-limit", default="5G",
                        help="also run the first budget inside a memory cgroup of this limit (page cache "
                             "included); needs a writable /sys/fs/cgroup/memory")
    parser.add_argument("--only-cgroup", action="store_true",
                        help="run only the cgroup step and add it to an existing report")
    args = parser.parse_args()
    from slimwise.perf.presets import build_synthetic

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    big, small = work / f"cpu-{args.layers}l", work / f"cpu-{args.small_layers}l"
    for path, layers in ((big, args.layers), (small, args.small_layers)):
        if not (path / "config.json").exists():
            t0 = time.perf_counter()
            build_synthetic("cpu", path, layers=layers, seed=0)
            print(f"built {path} in {time.perf_counter() - t0:.0f}s", flush=True)
    data = work / "calib.jsonl"
    # the synthetic tokenizer is word-level over "t4" ... "t4095": random words are random token ids
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 4096, (args.prompts, args.prompt_len), generator=gen).tolist()
    data.write_text("".join(json.dumps({"prompt": " ".join(f"t{i}" for i in row)}) + "\n" for row in ids))
    common = ["--data", str(data), "--phase", "prompt", "--dtype", "bfloat16", "--batch-size", "16"]
    budgets = args.budgets.split(",")
    if args.only_cgroup:
        path = out / "out-of-core-calibration.json"
        report = json.loads(path.read_text())
        report["cgroup"] = in_cgroup(big, common, budgets[0], args.cgroup_limit, work)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["cgroup"], indent=1))
        return
    report: dict = {"lscpu_model": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
                    "checkpoint": {"path": str(big), "layers": args.layers,
                                   "bytes": checkpoint_bytes(big)},
                    "small_checkpoint": {"path": str(small), "layers": args.small_layers,
                                         "bytes": checkpoint_bytes(small)},
                    "prompts": args.prompts, "prompt_len": args.prompt_len, "runs": {}}
    for budget in args.budgets.split(","):
        name = f"calibrate_{budget}"
        stats = work / f"stats-{budget}.safetensors"
        report["runs"][name] = timed(["calibrate", str(big), *common, "--max-memory", f"cpu={budget}",
                                      "--out", str(stats)], work / f"{name}.log")
        print(name, json.dumps(report["runs"][name]), flush=True)
    report["budgets_identical"] = same_stats(work / f"stats-{budgets[0]}.safetensors",
                                             work / f"stats-{budgets[-1]}.safetensors")
    subprocess.run([sys.executable, "-m", "slimwise.cli", "plan", "--stats",
                    str(work / f"stats-{budgets[0]}.safetensors"), "--criterion", "reap", "--ratio", "0.5",
                    "--out", str(work / "plan.json")], check=True, cwd=ROOT)
    report["runs"]["prune"] = timed(["prune", str(big), "--plan", str(work / "plan.json"), "--out",
                                     str(work / "pruned"), "--force"], work / "prune.log")
    report["pruned_bytes"] = checkpoint_bytes(work / "pruned")
    small_runs = (("small_in_memory", []), ("small_streamed", ["--max-memory", f"cpu={args.small_budget}"]))
    for name, extra in small_runs:
        report["runs"][name] = timed(["calibrate", str(small), *common, *extra,
                                      "--out", str(work / f"{name}.safetensors")], work / f"{name}.log")
    report["small_streamed_vs_in_memory"] = same_stats(work / "small_in_memory.safetensors",
                                                       work / "small_streamed.safetensors")
    (out / "out-of-core-calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    print("| run | peak RSS | of it anonymous | of it file-backed | wall | read from storage | written |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, run in report["runs"].items():
        print(f"| {name} | {run['peak_rss_gib']} GiB | {run['peak_anon_gib']} GiB | "
              f"{run['peak_file_gib']} GiB | {run['wall_s']} s | {run['read_gb']} GB | "
              f"{run['written_gb']} GB |")
    print(json.dumps({k: report[k] for k in ("budgets_identical", "small_streamed_vs_in_memory")}, indent=1))


if __name__ == "__main__":
    main()
