"""The suite's report: one Markdown file and its PNG plots, built from a run directory's JSON.

    tandem bench report RUN_DIR [--output FILE]     (default RUN_DIR/report.md, plots beside it)

Only what the sections measured goes in: a skipped or failed section shows as such, with its reason, and
no figure is carried over from another run. A ``notes.md`` in the run directory (a person's reading of
the figures) is included below the summary table. Each table says which command produced it (the manifest,
``suite.json``, records every section's command line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from benchmarks.manifest import SectionResult, SuiteRun, load_run


def _load(run_dir: Path, section: SectionResult) -> dict[str, Any] | None:
    if section.status != "ok" or section.json_file is None:
        return None
    return json.loads((run_dir / section.json_file).read_text())


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    marks = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|",
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def _image(lines: list[str], path: Path | None, base: Path, alt: str) -> None:
    if path is not None:
        lines += [f"![{alt}]({os.path.relpath(path, base)})", ""]


def machine_lines(run: SuiteRun, roofline: dict[str, Any] | None) -> list[str]:
    lines = [f"- Command: `{run.command}` ({run.total_seconds / 60:.1f} min, started {run.started})",
             f"- Model: {run.model}, {run.dtype}; {run.threads} torch thread{'s' if run.threads != 1 else ''} for the "
             "offline sections and peers"]
    if run.cpu:
        lines.append(f"- CPU: {run.cpu}")
    if roofline:
        m = roofline["machine"]
        lines.append(f"- CPU{' (roofline section)' if run.cpu else ''}: {m['cpu']}, {m['cores']} cores; last-level "
                     f"cache {_fmt(m['llc_bytes'] / 2**20, 0) + ' MiB' if m.get('llc_bytes') else 'unknown'}")
    lines.append(f"- Python {platform.python_version()}, {platform.system()} {platform.release()}")
    return lines + [""]


def roofline_lines(roofline: dict[str, Any], measured: dict[int, tuple[float, str]]) -> list[str]:
    """The machine's limits, the model's bytes per step, and the roofline beside what Tandem reached."""
    m, model = roofline["machine"], roofline["model"]
    lines = _table(["limit", "measured"], [
        ["memory bandwidth, read (GB/s)", _fmt(m["read_gb_s"])],
        ["memory bandwidth, copy (GB/s)", _fmt(m["copy_gb_s"])],
        *[[f"matmul {dtype}, large GEMM (GFLOP/s)", _fmt(v)] for dtype, v in m["matmul_gflops"].items()],
        *[[f"matmul {dtype}, decode-shaped GEMM (GFLOP/s)", _fmt(v)] for dtype, v in m["decode_gemm_gflops"].items()],
        [f"{model['name']} weights read per decode step ({model['dtype']}, MB)",
         _fmt(model["weight_bytes_per_step"] / 1e6)],
        ["KV cache per token (KB)", _fmt(model["kv_bytes_per_token"] / 1e3, 2)],
        ["FLOPs per token (MFLOP)", _fmt(model["flops_per_token"] / 1e6)],
    ])
    rows = []
    for r in roofline["roofline"]:
        got, how = measured.get(r["batch"], (None, ""))
        share = f"{got / r['tokens_per_s']:.0%}" if got else "-"
        rows.append([str(r["batch"]), str(r["context"]), _fmt(r["bytes_per_step"] / 1e6), r["bound"],
                     _fmt(r["tokens_per_s"]), _fmt(got), share, how])
    lines += _table(["batch", "context", "MB per step", "bound", "roofline tok/s", "Tandem tok/s", "of roofline",
                     "measured by"], rows, "rrrlrrrl")
    return lines


def offline_lines(offline: dict[str, Any] | None, peers: list[tuple[SectionResult, dict[str, Any] | None]]
                  ) -> tuple[list[str], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    if offline:
        w = offline["workload"]
        lines += [f"{w['num_prompts']} prompts x {w['prompt_len']} random token ids -> {w['output_len']} new tokens "
                  "each, greedy, EOS ignored, all submitted at once; tok/s = output tokens / wall time, prefill "
                  "included.", ""]
        rows += [r for r in offline["results"] if r["output_tokens"]]
    for _, data in peers:
        if data is not None:
            rows.append({**data, "note": "; ".join(x for x in (data.get("note", ""),
                                                                 f"start-up {data['init_seconds']:.0f} s") if x)})
    base = next((r["tokens_per_s"] for r in rows if r["system"] == "Tandem"), None)
    table = [[r["system"], r["dtype"], r["setting"], _fmt(r["tokens_per_s"]),
              f"{r['tokens_per_s'] / base:.2f}x" if base else "-", r.get("note", "")] for r in rows]
    lines += _table(["system", "dtype", "setting", "tok/s", "vs Tandem", "note"], table, "lllrrl")
    lines += [f"- {s.title}: **{s.status}** — {s.note}" for s, data in peers if data is None]
    return lines + ([""] if any(data is None for _, data in peers) else []), rows


def speculative_lines(spec: dict[str, Any]) -> list[str]:
    threads = f"{spec['threads']} thread{'s' if spec['threads'] != 1 else ''}"
    lines = [f"Batch 1, {threads}, {spec['dtype']}, greedy, at most {spec['max_tokens']} tokens, "
             f"{len(spec['prompts'])} chat prompts; decode tok/s excludes the prefill.", ""]
    rows = [[r["category"], r["config"], _fmt(r["decode_tokens_per_s"]), f"{r['speedup']:.2f}x",
             f"{r['tokens_per_step']:.2f}", "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
             f"{r['identical']}/{r['prompts']}"] for r in spec["rows"]]
    return lines + _table(["prompts", "configuration", "decode tok/s", "speed-up", "tokens/step", "acceptance",
                           "same output as plain"], rows, "llrrrrr")


def kv_transfer_lines(kv: dict[str, Any]) -> list[str]:
    rows = [[str(r["tokens"]), _fmt(r["bytes"] / 1e6), r.get("transport", kv.get("backend", "")), r["case"],
             _fmt(r["median_ms"], 2), _fmt(r["gb_s"], 2), f"{r['vs_raw']:.0%}",
             f"{r['vs_memcpy']:.0%}" if "vs_memcpy" in r else ""] for r in kv["rows"]]
    transports = ", ".join(kv.get("transports", [kv.get("backend", "")]))
    return [f"{kv['model']} KV blocks ({kv['bytes_per_block']:,} bytes per {kv['block_size']} tokens) between two "
            f"processes on this host ({transports}), median of {kv['iters']} rounds.", "",
            *_table(["tokens", "MB", "transport", "case", "median ms", "GB/s", "vs raw send", "vs memcpy"], rows,
                    "rrllrrrr")]


def http_relay_lines(relay: dict[str, Any]) -> list[str]:
    rows = [["OpenAI HTTP (SSE)" if r["api"] == "openai" else "gRPC", str(r["streams"]), str(r["tokens_per_request"]),
             f"{r['tokens_per_s']:,.0f}", _fmt(r["cpu_ms_per_1k_tokens"], 0)] for r in relay["rows"]]
    return [f"Streamed tokens/s through one gateway process over loopback from scripted nodes ({relay['cpu']}, "
            f"{relay['cores']} cores shared by client, gateway and nodes); goal over HTTP: "
            f"{relay['goal_tokens_per_s']:,.0f} tokens/s.", "",
            *_table(["front", "streams", "tokens/request", "tokens/s", "gateway CPU ms / 1k tokens"], rows, "lrrrr")]


def serving_lines(data: dict[str, Any]) -> list[str]:
    systems = data["systems"]
    w = data["workload"]
    params = ", ".join(f"{k} {v}" for k, v in w.items() if k != "name")
    rates = data.get("rates") or ([data["rate"]] if data.get("rate") else [])
    load = f"Poisson arrivals at {', '.join(f'{r:g}' for r in rates)} requests/s" if rates else \
        f"closed loop, {data.get('concurrency')} in flight"
    lines = [f"Workload `{w['name']}` ({params}); {load}; {data['dtype']}; cores {data['cpus']}.", ""]
    if slo := data.get("slo"):
        lines += [f"Goodput: requests/s meeting both SLOs (TTFT <= {slo['ttft_s'] * 1e3:g} ms, TPOT <= "
                  f"{slo['tpot_s'] * 1e3:g} ms); SLO attainment: % of all requests meeting them.", ""]

    def dist(s: dict[str, Any], key: str, stat: str, scale: float = 1e3) -> str:
        d = s.get(key)
        return "-" if not d else _fmt(d[stat] * scale, 0 if d[stat] * scale >= 100 else 1)

    def attained(s: dict[str, Any], key: str) -> str:
        a = s.get("slo")
        return "-" if not a or not a["num_requests"] else f"{100 * a[key] / a['num_requests']:.0f}"

    rows = [["completed / failed", *[f"{s['completed']} / {s['failed']}" if s.get("started", True)
                                     else f"failed to start ({s['failed']})" for s in systems]],
            ["requests/s", *[_fmt(s["request_throughput"], 3) for s in systems]]]
    if any(s.get("slo") for s in systems):
        rows += [["goodput (requests/s meeting both SLOs)", *[_fmt(s.get("goodput"), 3) for s in systems]],
                 *[[f"SLO attainment, {label} (%)", *[attained(s, key) for s in systems]]
                   for label, key in (("both", "met_both"), ("TTFT", "met_ttft"), ("TPOT", "met_tpot"))]]
    rows.append(["output tokens/s", *[_fmt(s["output_throughput"]) for s in systems]])
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s")):
        rows += [[f"{label} {stat} (ms)", *[dist(s, key, stat) for s in systems]] for stat in ("p50", "p90", "p99")]
    rows.append(["KV transfer p50 (ms)", *[dist(s, "kv_transfer_s", "p50") for s in systems]])
    kinds = sorted({k for s in systems for k in s.get("by_kind", {})})
    if len(kinds) > 1:
        for kind in kinds:
            for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
                rows += [[f"{kind}: {label} {stat} (ms)",
                          *[dist(s.get("by_kind", {}).get(kind, {}), key, stat) for s in systems]]
                         for stat in ("p50", "p99")]
    lines += _table(["metric", *[s["system"] for s in systems]], rows)
    if caps := data.get("capacity"):
        target = data.get("capacity_attainment", 0.9)
        lines += ["", f"Goodput over the rate sweep (DistServe): each system's highest rate with >= {target:.0%} SLO "
                  "attainment.", "",
                  *_table(["system", "highest rate (requests/s)"],
                          [[name, "none" if cap is None else f"{cap:g}"] for name, cap in caps.items()], "lr")]
    lines += [f"- {s['system']}: {s['placement']}" for s in systems]
    return lines + [""]


def measured_rates(offline: dict[str, Any] | None, spec: dict[str, Any] | None) -> dict[int, tuple[float, str]]:
    """Tandem's decode rates to set beside the roofline: batch 1 from the speculative section's plain decoding,
    the full batch from the offline section's decode-step profile."""
    out: dict[int, tuple[float, str]] = {}
    if spec:
        plain = [r for r in spec["rows"] if not r["speculative"]]
        if plain:
            r = min(plain, key=lambda r: r["category"] != "open-ended")
            out[1] = (r["decode_tokens_per_s"], f"speculative section, plain decoding, {spec['threads']} thread"
                                     + ("s" if spec["threads"] != 1 else ""))
    if offline:
        for profile in offline.get("profiles", {}).values():
            out[profile["batch"]] = (1e3 * profile["batch"] / profile["ms_per_step"],
                                     f"offline section, decode steps of {profile['batch']}")
    return out


def write_report(run_dir: Path, output: Path | None = None) -> Path:
    """Build the report of the run in ``run_dir``; plots go to ``<output's stem>-plots/`` beside it."""
    from benchmarks import plots  # matplotlib: only when a report is drawn

    run = load_run(run_dir)
    output = output or run_dir / "report.md"
    plot_dir = output.parent / f"{output.stem}-plots"
    base = output.parent
    by_name = {s.name: s for s in run.sections}
    data = {s.name: _load(run_dir, s) for s in run.sections}
    roofline, offline, spec = data.get("roofline"), data.get("offline"), data.get("speculative")

    lines = [f"# Tandem benchmark report — {run.model}", "", *machine_lines(run, roofline)]
    lines += _table(["section", "status", "time (s)", "note"],
                    [[s.title, s.status, _fmt(s.seconds, 0), s.note.replace("|", "/")[:300]] for s in run.sections],
                    "llrl")
    # A run's own reading of its figures (written by a person after the run) goes right below the summary.
    if (notes := run_dir / "notes.md").is_file():
        lines += [notes.read_text().strip(), ""]
    measured = measured_rates(offline, spec)
    if roofline:
        lines += ["## Limits of this machine", "", f"`{by_name['roofline'].command}`", "",
                  *roofline_lines(roofline, measured)]
    peers = [(by_name[n], data.get(n)) for n in ("peer-vllm", "peer-llamacpp") if n in by_name]
    if offline or any(d for _, d in peers):
        lines += ["## Offline throughput", ""]
        lines += [f"- `{s.command}`" for s in [by_name.get("offline"), *(p for p, _ in peers)] if s and s.command]
        body, rows = offline_lines(offline, peers)
        lines += ["", *body]
        batched = next((r["tokens_per_s"] for r in (roofline or {}).get("roofline", []) if r["batch"] > 1), None)
        _image(lines, plots.offline_throughput(rows, batched, plot_dir / "offline_throughput.png"), base,
               "offline throughput")
    if spec:
        lines += ["## Speculative decoding", "", f"`{by_name['speculative'].command}`", "", *speculative_lines(spec)]
        _image(lines, plots.speculative_speedup(spec["rows"], plot_dir / "speculative_speedup.png"), base,
               "speculative speed-up")
    if kv := data.get("kv-transfer"):
        lines += ["## KV transfer", "", f"`{by_name['kv-transfer'].command}`", "", *kv_transfer_lines(kv)]
        _image(lines, plots.kv_transfer_bandwidth(kv["rows"], plot_dir / "kv_transfer_bandwidth.png"), base,
               "KV transfer bandwidth")
    if relay := data.get("http-relay"):
        lines += [f"## {by_name['http-relay'].title}", "", f"`{by_name['http-relay'].command}`", "",
                  *http_relay_lines(relay), ""]
    if quant := data.get("quantization"):
        from benchmarks.bench_quant import report_lines as quantization_lines  # torch: only for this section

        lines += [f"## {by_name['quantization'].title}", "", f"`{by_name['quantization'].command}`", "",
                  *quantization_lines(quant), ""]
    if moe := data.get("moe"):
        from benchmarks.bench_moe import markdown as moe_lines  # torch: only for this section

        lines += [f"## {by_name['moe'].title}", "", f"`{by_name['moe'].command}`", "", moe_lines(moe), ""]
    for name in ("serve-vllm", "serve-llamacpp"):
        if data.get(name):  # the section's own Markdown, its headings one level down
            own = (run_dir / f"{name}.md").read_text().splitlines()
            lines += [f"## {by_name[name].title}", "", f"`{by_name[name].command}`", "",
                      *(f"#{line}" if line.startswith("## ") else line for line in own if not line.startswith("# ")),
                      ""]
    for name in ("serve-serving", "serve-shared-prefix", "serve-mixed", "serve-multi-turn"):
        if serve := data.get(name):
            lines += [f"## {by_name[name].title}", "", f"`{by_name[name].command}`", "", *serving_lines(serve)]
            _image(lines, plots.serving_latency(serve, plot_dir / f"{name}_latency.png"), base, f"{name} latency")
    output.write_text("\n".join(lines).rstrip() + "\n")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    print(write_report(Path(args.run_dir), Path(args.output) if args.output else None))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a directory written by `tandem bench run`")
    p.add_argument("--output", help="the Markdown file to write [RUN_DIR/report.md]; plots go beside it")


if __name__ == "__main__":
    sys.exit(main())
