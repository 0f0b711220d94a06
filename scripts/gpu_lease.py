"""The GPU lease: one call on a lent GPU machine, as that machine is, returns the truth about Tandem's GPU paths.

    scripts/gpu-lease.sh OUT [DEADLINE_S] [--bundle DIR] [--scratch DIR]

Runs on the interpreter that starts it (the device image's own python3: no venv, no network). It installs
the bundle `make gpu-bundle` made (wheels with pip --no-index into SCRATCH/site, put first on PYTHONPATH;
the protobuf stubs into tandem/v1), then runs its steps in order, each time-boxed (its process group killed at
its budget) and clipped to the overall deadline, never stopping on a failed step: facts; the FlashInfer JIT
warm-up in the background; every GPU test on parallel workers with TANDEM_TEST_REQUIRE_GPU=1 (a missing GPU
piece fails rather than skips); then the measurements of benchmarks/gpu_check.py one section per step,
cheapest first, and end-to-end tokens/s on random-weight SmolLM2-shaped and Llama-3-8B-shaped models whose
weights are generated in SCRATCH (never in OUT). Without CUDA every GPU step reports "skipped: no CUDA".

OUT receives five files, rewritten after every step: gpu-lease.json, gpu-lease.md, lease.log (every step's
output), pytest.log and junit.xml. Exit status 0 whenever the report was written.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_lease_report import goals, junit_summary, log_summary, markdown

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("gpu_lease_worker.py")
DEFAULT_DEADLINE_S = 500.0
RESERVE_S = 5.0  # kept back from the deadline for the last report
MIN_STEP_S = 5.0  # a step with less time than this left is skipped, not started
Row = dict[str, Any]
OUT_FILES = ("gpu-lease.json", "gpu-lease.md", "lease.log", "pytest.log", "junit.xml")  # all that OUT receives

# Test files that touch CUDA: those with a `gpu` mark or a CUDA check (gpu_test_files), and in them the tests
# whose names or marks say GPU, CUDA, Triton (compiled for real when CUDA is there), FlashInfer or NCCL.
GPU_TEST_KEYWORDS = "gpu or cuda or triton or flash or nccl"
GPU_TEST_WORKERS = 8
# benchmarks/gpu_check.py's sections, cheapest first; sections it gains later run after these, e2e ones last.
MEASURE_ORDER = ("copy", "decode", "extend", "prefill", "graphs", "kv-ipc")
E2E = {"e2e": ("smollm2-135m", 64, 128), "e2e-8b": ("llama3-8b", 32, 64)}  # model, prompts, tokens
LOG_TAIL = 200_000  # characters of one step's output kept in lease.log
SET_UP = ("install", "facts", "flashinfer-warmup", "gpu-tests")  # the steps before the measurements
BUDGET_S = {"install": 90, "facts": 60, "flashinfer-warmup": 300, "gpu-tests": 200, "copy": 45, "decode": 90,
            "extend": 60, "prefill": 60, "graphs": 60, "kv-ipc": 120, "e2e": 150, "e2e-8b": 300}

FACTS_CODE = r"""
import importlib, importlib.metadata as md, json, sys
facts = {"python": sys.version.split()[0], "executable": sys.executable, "versions": {}, "imports": {}}
for name in ("torch", "triton", "flashinfer-python", "apache-tvm-ffi", "grpcio", "protobuf", "transformers",
             "tokenizers", "safetensors", "numpy", "pytest", "pytest-xdist", "pytest-timeout", "hypothesis",
             *sys.argv[1:]):  # and the bundle's packages: each read where the lease's path finds it
    try:
        facts["versions"][name] = md.version(name)
    except md.PackageNotFoundError:
        facts["versions"][name] = None
for module in ("torch", "triton", "flashinfer", "xdist", "tandem.v1.generate_pb2_grpc", "common.engine.llm",
               "benchmarks.gpu_check"):
    try:
        importlib.import_module(module)
        facts["imports"][module] = "ok"
    except BaseException as exc:
        facts["imports"][module] = f"{type(exc).__name__}: {exc}"[:300]
try:
    import torch
    facts["cuda_available"] = torch.cuda.is_available()
    facts["torch_cuda"] = torch.version.cuda
    if facts["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        facts["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "count": torch.cuda.device_count(),
                        "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}
except BaseException as exc:
    facts["cuda_available"] = False
    facts["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(facts))
"""


@dataclass
class Step:
    name: str
    what: str
    needs_cuda: bool = True
    status: str = "pending"  # pending, running, ok, failed, timed out, skipped
    reason: str = ""
    seconds: float | None = None
    budget_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """What one step's command did: exit status (None: killed at its time box) and its output."""

    rc: int | None
    output: str
    seconds: float


class Interrupted(Exception):
    pass


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """tests/**/test_*.py that mark a test `gpu` or check for CUDA: the files the lease's pytest reads."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "mark.gpu" in text or "torch.cuda.is_available()" in text:
            found.append(path.relative_to(root).as_posix())
    return found


def gpu_check_sections(root: Path = ROOT) -> list[str]:
    """benchmarks/gpu_check.py's SECTIONS (read from its source: the lease's own Python may lack torch)."""
    tree = ast.parse((root / "benchmarks" / "gpu_check.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SECTIONS" for t in node.targets):
            value = ast.literal_eval(node.value)
            return [str(s) for s in value]
    return []


def measurement_order(sections: list[str]) -> list[str]:
    known = [s for s in MEASURE_ORDER if s in sections]
    new = [s for s in sections if s not in MEASURE_ORDER and s not in E2E]
    return [*known, *new, *E2E]


class Lease:
    def __init__(self, out: Path, deadline_s: float, bundle: Path, scratch: Path) -> None:
        self.out, self.deadline_s, self.bundle, self.scratch = out, deadline_s, bundle, scratch
        self.started = time.monotonic()
        self.started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.python = sys.executable
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_HOME": str(scratch / "home")}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.facts: dict[str, Any] = {}
        self.rows: list[Row] = []
        self.finished = False
        self.missing: dict[str, str] = {}  # what `make gpu-bundle` could not obtain (package or "models") -> why
        self.warmup: tuple[subprocess.Popen[bytes], float, float, Path] | None = None  # process, start, budget, log
        self.steps = [Step("install", "the bundle's wheels (pip --no-index) and stubs", needs_cuda=False),
                      Step("facts", "GPU, driver, versions, imports", needs_cuda=False),
                      Step("flashinfer-warmup", "FlashInfer JIT for the measured shapes, in the background"),
                      Step("gpu-tests", f"pytest -k '{GPU_TEST_KEYWORDS}' over the GPU test files, "
                                        f"{GPU_TEST_WORKERS} workers, TANDEM_TEST_REQUIRE_GPU=1")]
        for section in measurement_order(gpu_check_sections()):
            what = (f"tokens/s, random-weight {E2E[section][0]} (bf16, triton)" if section in E2E
                    else f"python -m benchmarks.gpu_check --sections {section}")
            self.steps.append(Step(section, what))

    # -- time ---------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.deadline_s - RESERVE_S - self.elapsed()

    # -- running commands ---------------------------------------------------------------------------------
    def command(self, argv: list[str], budget_s: float, log: Path, env: dict[str, str] | None = None) -> Outcome:
        """Run ``argv`` in its own process group with output to ``log``; kill the group at ``budget_s``."""
        started = time.monotonic()
        with log.open("wb") as sink:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                if proc.poll() is None:
                    kill_group(proc)
        return Outcome(rc, log.read_text(errors="replace"), time.monotonic() - started)

    def log(self, step: Step, text: str) -> None:
        """Append a step's output to OUT/lease.log: its last LOG_TAIL characters (a file comes back whole or not)."""
        text = text.rstrip()
        if len(text) > LOG_TAIL:
            text = f"[{len(text) - LOG_TAIL} characters left out]\n{text[-LOG_TAIL:]}"
        with (self.out / "lease.log").open("a") as sink:
            sink.write(f"\n== {step.name} ({self.elapsed():.0f}s into the lease)\n{text}\n")

    def python_step(self, step: Step, argv: list[str], budget_s: float,
                    env: dict[str, str] | None = None) -> Outcome:
        outcome = self.command([self.python, *argv], budget_s, self.scratch / "logs" / f"{step.name}.log", env)
        self.log(step, outcome.output)
        return outcome

    # -- the report ---------------------------------------------------------------------------------------
    def write(self) -> None:
        report = {"started_utc": self.started_utc, "deadline_s": self.deadline_s, "elapsed_s": round(self.elapsed(), 1),
                  "finished": self.finished, "python": self.python, "bundle": str(self.bundle),
                  "scratch": str(self.scratch), "facts": self.facts, "steps": [asdict(s) for s in self.steps],
                  "rows": self.rows, "goals": goals(self.rows)}
        for name, text in (("gpu-lease.json", json.dumps(report, indent=2) + "\n"), ("gpu-lease.md", markdown(report))):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    # -- the run ------------------------------------------------------------------------------------------
    def run(self) -> None:
        (self.scratch / "logs").mkdir(parents=True, exist_ok=True)
        for name in OUT_FILES:  # a reused OUT: no file of an earlier lease is mistaken for this one's
            (self.out / name).unlink(missing_ok=True)
        self.write()
        try:
            for step in self.steps:
                self.run_step(step)
            self.join_warmup()
        finally:
            self.finished = True
            if self.warmup is not None and self.warmup[0].poll() is None:
                kill_group(self.warmup[0])
            self.write()

    def run_step(self, step: Step) -> None:
        if step.name not in SET_UP:
            self.join_warmup()  # measurements time a quiet GPU, FlashInfer's kernels already compiled
        budget = min(BUDGET_S.get(step.name, 120), self.left())
        step.budget_s = round(budget, 1)
        if budget < MIN_STEP_S:
            return self.finish(step, "skipped", f"deadline: {max(self.left(), 0):.0f}s left of {self.deadline_s:.0f}s")
        if step.needs_cuda and not self.facts.get("cuda_available"):
            told = "cuda_available" in self.facts
            why = self.facts.get("torch_error") or ("torch.cuda.is_available() is False" if told
                                                    else "the facts step could not tell")
            return self.finish(step, "skipped", f"no CUDA ({why})")
        step.status = "running"
        self.write()
        started = time.monotonic()
        try:
            status, reason = self.dispatch(step, budget)
        except (Interrupted, KeyboardInterrupt):
            self.finish(step, "failed", "interrupted (the lease was stopped)", time.monotonic() - started)
            raise
        except Exception as exc:  # a bug here must not cost the other steps
            status, reason = "failed", f"lease error: {type(exc).__name__}: {exc}"[:300]
        return self.finish(step, status, reason, None if status == "running" else time.monotonic() - started)

    def finish(self, step: Step, status: str, reason: str = "", seconds: float | None = None) -> None:
        step.status, step.reason = status, reason
        if seconds is not None:
            step.seconds = round(seconds, 1)
        print(f"[{self.elapsed():5.0f}s] {step.name}: {status}{': ' + reason if reason else ''}", flush=True)
        self.write()

    def dispatch(self, step: Step, budget: float) -> tuple[str, str]:
        if step.name == "install":
            return self.install(step, budget)
        if step.name == "facts":
            return self.gather_facts(step, budget)
        if step.name == "flashinfer-warmup":
            return self.start_warmup(step, budget)
        if step.name == "gpu-tests":
            return self.gpu_tests(step, budget)
        if step.name in E2E:
            return self.end_to_end(step, budget)
        return self.measure(step, budget)

    # -- steps --------------------------------------------------------------------------------------------
    def install(self, step: Step, budget: float) -> tuple[str, str]:
        wheels = sorted((self.bundle / "wheels").glob("*.whl"))
        manifest_path = self.bundle / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        step.detail["missing_from_bundle"] = manifest.get("missing", [])
        self.missing = {m["item"].split("=")[0].split(">")[0]: m["reason"] for m in manifest.get("missing", [])}
        lacking = "; ".join(f"{m['item']}: {m['reason']}" for m in manifest.get("missing", []))
        if not wheels and not (self.bundle / "stubs").is_dir():
            return "skipped", f"no bundle at {self.bundle} (make gpu-bundle, then carry it): this Python's packages"
        status, notes = "ok", []
        if wheels:
            site = self.scratch / "site"
            argv = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--disable-pip-version-check", "--upgrade", "--target", str(site)]
            if (self.bundle / "constraints.txt").is_file():
                argv += ["-c", str(self.bundle / "constraints.txt")]
            outcome = self.python_step(step, [*argv, *map(str, wheels)], budget)
            if outcome.rc != 0:
                status = "failed"
                notes.append(f"pip install exited {outcome.rc}: {last_line(outcome.output)}")
            else:
                notes.append(f"{len(wheels)} wheels into {site}")
            # First on the path: the carried grpcio / protobuf are the versions the stubs need.
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), self.env["PYTHONPATH"]])
        copied = install_stubs(self.bundle / "stubs", ROOT)
        if copied is not None:
            notes.append(f"{copied} stub files copied into tandem/v1" if copied else "stubs already in tandem/v1")
        if lacking:
            notes.append(f"not in the bundle: {lacking}")
        return status, "; ".join(notes)

    def gather_facts(self, step: Step, budget: float) -> tuple[str, str]:
        started = self.elapsed()
        smi = shutil.which("nvidia-smi")
        if smi:
            outcome = self.command([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                   min(budget, 20), self.scratch / "logs" / "nvidia-smi.log")
            self.log(step, outcome.output)
            self.facts["nvidia_smi"] = outcome.output.strip().splitlines()
        else:
            self.facts["nvidia_smi"] = ["nvidia-smi: not found"]
        nvcc = shutil.which("nvcc")  # FlashInfer's JIT compiles with it
        if nvcc:
            outcome = self.command([nvcc, "--version"], min(budget, 10), self.scratch / "logs" / "nvcc.log")
        self.facts["nvcc"] = last_line(outcome.output) if nvcc else "nvcc: not found"
        constraints = self.bundle / "constraints.txt"
        carried = [line.split("==")[0] for line in constraints.read_text().split()] if constraints.is_file() else []
        budget = max(budget - (self.elapsed() - started), MIN_STEP_S)
        outcome = self.python_step(step, ["-c", FACTS_CODE, *carried], budget)
        found = next((line for line in reversed(outcome.output.splitlines()) if line.startswith("{")), None)
        if found is None:
            return ("timed out" if outcome.rc is None else "failed"), last_line(outcome.output)
        self.facts.update(json.loads(found))
        gpu = self.facts.get("gpu", {}).get("name") or "no CUDA"
        versions = self.facts.get("versions", {})
        return "ok", (f"{gpu}; torch {versions.get('torch')} (CUDA {self.facts.get('torch_cuda')}), triton "
                      f"{versions.get('triton')}, flashinfer {versions.get('flashinfer-python')}")

    def start_warmup(self, step: Step, budget: float) -> tuple[str, str]:
        if "flashinfer-python" in self.missing:
            return "skipped", f"flashinfer-python not in the bundle: {self.missing['flashinfer-python']}"
        if self.facts.get("imports", {}).get("flashinfer") != "ok":
            return "skipped", f"flashinfer not importable: {self.facts.get('imports', {}).get('flashinfer')}"
        log = self.scratch / "logs" / "flashinfer-warmup.log"
        sink = log.open("wb")
        proc = subprocess.Popen([self.python, str(WORKER), "warmup"], cwd=ROOT, env=self.env, stdout=sink,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        sink.close()
        self.warmup = (proc, time.monotonic(), budget, log)
        return "running", "started in the background"

    def join_warmup(self) -> None:
        """Wait for the background warm-up (bounded by its budget and the deadline) and report it."""
        if self.warmup is None:
            return
        proc, started, budget, log = self.warmup
        self.warmup = None
        step = next(s for s in self.steps if s.name == "flashinfer-warmup")
        try:
            rc: int | None = proc.wait(timeout=max(0.0, min(started + budget - time.monotonic(), self.left())))
        except subprocess.TimeoutExpired:
            rc = None
            kill_group(proc)
        output = log.read_text(errors="replace")
        self.log(step, output)
        rows = json_rows(output)
        step.detail["rows"] = rows
        errors = [r["error"] for r in rows if "error" in r]
        if rc is None:
            self.finish(step, "timed out", f"after {time.monotonic() - started:.0f}s", time.monotonic() - started)
        elif rc != 0 or errors:
            self.finish(step, "failed", (errors or [last_line(output)])[0], time.monotonic() - started)
        else:
            self.finish(step, "ok", f"{len(rows)} shapes compiled", time.monotonic() - started)

    def gpu_tests(self, step: Step, budget: float) -> tuple[str, str]:
        files = gpu_test_files()
        junit = self.out / "junit.xml"
        workers = ["-n", str(GPU_TEST_WORKERS)] if self.facts.get("imports", {}).get("xdist") == "ok" else []
        argv = [self.python, "-m", "pytest", "-v", *workers, "-p", "no:cacheprovider", "-o", "timeout=150", "-rfEs",
                f"--junitxml={junit}", "-k", GPU_TEST_KEYWORDS, *files]
        env = {**self.env, "TANDEM_TEST_REQUIRE_GPU": "1"}
        outcome = self.command(argv, budget, self.out / "pytest.log", env)
        step.detail["files"] = files
        # junit.xml is written at the end; a run killed at its budget is counted from its -v lines instead.
        summary = junit_summary(junit) if junit.is_file() else log_summary(outcome.output)
        step.detail.update(summary)
        counts = ", ".join(f"{summary[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if summary.get(k))
        tail = last_line(outcome.output)
        if outcome.rc is None:
            return "timed out", f"after {outcome.seconds:.0f}s; {counts or tail}"
        if outcome.rc == 0:
            return "ok", counts or tail
        return "failed", f"pytest exited {outcome.rc}: {counts or tail}"

    def measure(self, step: Step, budget: float) -> tuple[str, str]:
        argv = ["-m", "benchmarks.gpu_check", "--out", str(self.scratch / "gpu-check" / step.name),
                "--sections", step.name]
        outcome = self.python_step(step, argv, budget)
        return self.take_rows(step, outcome)

    def end_to_end(self, step: Step, budget: float) -> tuple[str, str]:
        model, prompts, tokens = E2E[step.name]
        config = self.bundle / "models" / model / "config.json"
        if not config.is_file():
            return "skipped", f"no {config.relative_to(self.bundle)} in the bundle: {self.missing.get('models', '')}"
        argv = [str(WORKER), "e2e", "--section", step.name, "--config", str(config),
                "--tokenizer", str(self.bundle / "models" / "tokenizer"), "--dir", str(self.scratch / "models" / model),
                "--prompts", str(prompts), "--tokens", str(tokens)]
        outcome = self.python_step(step, argv, budget)
        return self.take_rows(step, outcome)

    def take_rows(self, step: Step, outcome: Outcome) -> tuple[str, str]:
        rows = json_rows(outcome.output)
        roof = next((r["gb_s"] for r in self.rows if r.get("section") == "copy" and "gb_s" in r), None)
        for row in rows:  # each section runs in its own process: the copy roof is applied here
            if row.get("section") in ("decode", "extend") and row.get("vs_copy") is None and roof and "gb_s" in row:
                row["vs_copy"] = row["gb_s"] / roof
        self.rows.extend(rows)
        errors = [str(r["error"]) for r in rows if "error" in r]
        if outcome.rc is None:
            return "timed out", f"after {outcome.seconds:.0f}s, {len(rows)} rows"
        if outcome.rc != 0:
            return "failed", f"exited {outcome.rc}: {last_line(outcome.output)}"
        if not rows:
            return "failed", f"no rows: {last_line(outcome.output)}"
        if errors:
            return "failed", f"{len(errors)} of {len(rows)} rows failed: {errors[0]}"
        return "ok", f"{len(rows)} rows"


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def install_stubs(stubs: Path, root: Path) -> int | None:
    """Copy the bundle's tandem/v1 stubs into the checkout where missing or different; None: no stubs."""
    source = stubs / "tandem" / "v1"
    if not source.is_dir():
        return None
    copied = 0
    for path in sorted(source.glob("*_pb2*.py")):
        target = root / "tandem" / "v1" / path.name
        if not target.is_file() or target.read_bytes() != path.read_bytes():
            shutil.copy(path, target)
            copied += 1
    return copied


def json_rows(output: str) -> list[Row]:
    rows = []
    for line in output.splitlines():
        if line.startswith("{") and '"section"' in line:
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-lease.sh", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder that comes back: reports and logs, no models")
    parser.add_argument("deadline_s", type=float, nargs="?", default=DEFAULT_DEADLINE_S)
    parser.add_argument("--bundle", type=Path, default=ROOT / "gpu-bundle")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/tandem-gpu-lease"),
                        help="site-packages, model weights, logs (outside OUT)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lease = Lease(args.out.resolve(), args.deadline_s, args.bundle.resolve(), args.scratch.resolve())

    def stop(signum: int, _frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    try:
        lease.run()
    except (Interrupted, KeyboardInterrupt):
        print("gpu-lease: stopped; the report holds what ran", file=sys.stderr)
        return 1
    print((lease.out / "gpu-lease.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
