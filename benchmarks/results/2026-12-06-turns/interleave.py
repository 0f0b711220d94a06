"""Issue 38's multi-turn command, systems interleaved across rounds, pooled per system (session 35; session 40:
``--baseline-system`` names the system the baseline checkout runs).

The machine's speed moves by 10-20% between runs minutes apart, and `bench_serve` runs its systems one after
another: a single run compares each system with another window of the machine (session 34 read disaggregated
0.82x colocated in one draw, 1.13x in the next). Here each seed runs in rounds whose order reverses (A B C,
then C B A), and every system's turns 3+ are pooled over the rounds; a system from another checkout (the
routing before this session's change) runs inside each round beside them.

    python interleave.py OUT_DIR --seeds 0,1 --rounds 2 [--systems A,B] [--baseline CHECKOUT] \
        [--baseline-system disaggregated+shared]                                  # runs, summarizes
    python interleave.py OUT_DIR --summarize                                      # the summary of OUT_DIR's runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

HERE_SYSTEMS = ["disaggregated+shared", "conditional+shared", "colocated+shared"]
COMMAND = ["--workload", "multi-turn", "--conversations", "12", "--turns", "6", "--system-len", "128",
           "--message-len", "32:192", "--output-len", "32:96", "--think-s", "20", "--rate", "0.5",
           "--num-blocks", "173", "--prefill-num-blocks", "120", "--decode-num-blocks", "226",
           "--kv-offload-gb", "2", "--dtype", "bfloat16"]
BASELINE = "conditional+shared"  # the system the baseline checkout runs (its routing is what changed)


def run_one(checkout: Path, systems: list[str], seed: int, out: Path, name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "benchmarks.bench_serve", *COMMAND, "--systems", ",".join(systems),
           "--seed", str(seed), "--json", str(out / f"{name}.json")]
    print(f"[{name}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    with open(out / f"{name}.md", "w") as report:
        subprocess.run(cmd, cwd=checkout, env=env, stdout=report, check=True)


def run_all(args: argparse.Namespace, out: Path) -> None:
    here = Path(__file__).resolve().parents[3]
    for seed in args.seeds:
        for r in range(args.rounds):
            forward = r % 2 == 0
            steps: list[tuple[Path, list[str], str]] = [(here, args.systems if forward else args.systems[::-1],
                                                         f"seed{seed}-r{r}")]
            if args.baseline:
                base = (Path(args.baseline), [args.baseline_system], f"seed{seed}-r{r}-baseline")
                steps = [*steps, base] if forward else [base, *steps]
            for checkout, systems, name in steps:
                run_one(checkout, systems, seed, out, name)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def p50_ratio_interval(a: list[float], b: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval of median(a) / median(b), each resampled on its own (seeded)."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                    for _ in range(draws))
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws)]


def median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval of the median (seeded)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws)]


def summarize(out: Path) -> str:
    pooled: dict[tuple[int, str], list[dict[str, float]]] = {}
    rounds: dict[tuple[int, str], list[float]] = {}
    by_round: dict[tuple[int, int, str], dict[int, float]] = {}  # (seed, round, system) -> request index -> TTFT
    for path in sorted(out.glob("seed*.json")):
        seed = int(path.name.removeprefix("seed").split("-")[0])
        round_ = int(path.stem.split("-")[1].removeprefix("r"))
        baseline = path.stem.endswith("-baseline")
        for system in json.loads(path.read_text())["systems"]:
            name = system["system"] + (" (before)" if baseline else "")
            turns = [r for r in system["records"] if r["ok"] and r["kind"] not in ("turn 1", "turn 2")]
            pooled.setdefault((seed, name), []).extend(turns)
            by_round[(seed, round_, name)] = {int(r["index"]): r["ttft_s"] for r in turns}
            rounds.setdefault((seed, name), []).append(statistics.median(r["ttft_s"] for r in turns) * 1000)
    lines = ["| seed | system | turns 3+ | TTFT p50 / p90 / p99 (ms) | vs colocated: p50s [90% interval] "
             "| vs colocated: paired, median [90% interval] | each round's p50 (ms) | TPOT p50 / p99 (ms) |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    for seed in sorted({s for s, _ in pooled}):
        base = [r["ttft_s"] * 1000 for r in pooled[(seed, "colocated+shared")]]
        colocated = statistics.median(base)
        for (s, name), turns in sorted(pooled.items()):
            if s != seed:
                continue
            ttft = [r["ttft_s"] * 1000 for r in turns]
            tpot = [r["tpot_s"] * 1000 for r in turns if r["tpot_s"]]
            p50 = statistics.median(ttft)
            low, high = p50_ratio_interval(ttft, base)
            paired = [mine[i] / theirs[i] for (sd, rd, n), mine in by_round.items() if sd == seed and n == name
                      for theirs in [by_round.get((sd, rd, "colocated+shared"), {})] for i in mine if i in theirs]
            p_low, p_high = median_interval(paired)
            lines.append(f"| {seed} | {name} | {len(turns)} | {p50:.0f} / {pct(ttft, 0.9):.0f} / "
                         f"{pct(ttft, 0.99):.0f} | {p50 / colocated:.2f}x [{low:.2f}-{high:.2f}] | "
                         f"{statistics.median(paired):.2f}x [{p_low:.2f}-{p_high:.2f}] | "
                         f"{', '.join(f'{v:.0f}' for v in rounds[(s, name)])} | "
                         f"{statistics.median(tpot):.1f} / {pct(tpot, 0.99):.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--systems", type=lambda s: s.split(","), default=HERE_SYSTEMS,
                   help=f"this checkout's systems, in the first round's order [{','.join(HERE_SYSTEMS)}]")
    p.add_argument("--baseline", help="a checkout whose --baseline-system runs inside each round")
    p.add_argument("--baseline-system", default=BASELINE, help=f"the baseline checkout's system [{BASELINE}]")
    p.add_argument("--summarize", action="store_true", help="only summarize the runs already in OUT")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        run_all(args, args.out)
    print(summarize(args.out))


if __name__ == "__main__":
    main()
