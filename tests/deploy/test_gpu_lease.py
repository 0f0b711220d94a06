"""The GPU lease (scripts/gpu-lease.sh) in a simulated lent machine: no CUDA, no network, a small bundle.

It must install the bundle offline, report every step (the GPU ones "skipped: no CUDA"), write its JSON and
Markdown, and exit 0 inside the deadline; the bundle script must refuse a folder over its size limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-lease.sh"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    """scripts/gpu_lease.py and its neighbours, imported as the lease imports them (scripts/ on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_bundle
    import gpu_lease
    import gpu_lease_report
    import gpu_lease_worker

    yield {"bundle": gpu_bundle, "lease": gpu_lease, "report": gpu_lease_report, "worker": gpu_lease_worker}


def _fake_bundle(path: Path) -> Path:
    """A bundle as `make gpu-bundle` lays it out, with one tiny pure-Python wheel and no stubs."""
    wheels = path / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "lease_probe-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("lease_probe/__init__.py", "VALUE = 1\n")
        whl.writestr("lease_probe-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: lease-probe\nVersion: 0.1\n")
        whl.writestr("lease_probe-0.1.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("lease_probe-0.1.dist-info/RECORD", "")
    (path / "constraints.txt").write_text("lease-probe==0.1\n")
    (path / "manifest.json").write_text(json.dumps(
        {"wheels": [{"name": "lease-probe", "version": "0.1"}],
         "missing": [{"item": "flashinfer-python==0.6.0", "reason": "left out of this test's bundle"}]}))
    for model in ("smollm2-135m", "llama3-8b"):
        (path / "models" / model).mkdir(parents=True)
        (path / "models" / model / "config.json").write_text(json.dumps(TINY))
    (path / "models" / "tokenizer").mkdir()
    return path


def _lease(tmp_path: Path, deadline_s: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT), str(out), deadline_s, "--bundle", str(_fake_bundle(tmp_path / "b")),
                           "--scratch", str(tmp_path / "scratch")],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a machine without CUDA")
def test_simulated_lease_reports_every_step_and_exits_cleanly(tmp_path: Path, scripts: dict[str, ModuleType]) -> None:
    done, out = _lease(tmp_path, "150")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu-lease.json", "gpu-lease.md", "lease.log"]  # at most 8 come back; no model among them
    assert all(p.stat().st_size < 1 << 20 for p in out.iterdir())
    report = json.loads((out / "gpu-lease.json").read_text())
    assert report["finished"] and report["elapsed_s"] < 150
    steps = {s["name"]: s for s in report["steps"]}
    sections = scripts["lease"].measurement_order(scripts["lease"].gpu_check_sections())
    assert list(steps) == ["install", "facts", "flashinfer-warmup", "gpu-tests", *sections]
    assert {"copy", "decode", "kv-ipc", "e2e", "e2e-8b"} <= set(sections) and sections[0] == "copy"

    install = steps["install"]
    assert install["status"] == "ok", install
    assert "1 wheels" in install["reason"] and "flashinfer-python==0.6.0: left out" in install["reason"]
    assert (tmp_path / "scratch" / "site" / "lease_probe" / "__init__.py").is_file()
    assert steps["facts"]["status"] == "ok", steps["facts"]
    facts = report["facts"]
    assert facts["cuda_available"] is False
    assert facts["versions"]["lease-probe"] == "0.1"  # the installed wheel reaches the steps' processes
    assert facts["imports"]["tandem.v1.generate_pb2_grpc"] == "ok"
    for name, step in steps.items():
        if name not in ("install", "facts"):
            assert step["status"] == "skipped" and step["reason"].startswith("no CUDA"), step

    page = (out / "gpu-lease.md").read_text()
    assert done.stdout.rstrip().endswith(page.rstrip())  # printed last, for the caller's output tail
    for name in steps:
        assert f"| {name} |" in page
    assert "| Triton paged decode vs HBM copy | 0.7 |  | not run" in page


def test_a_spent_deadline_skips_every_step_and_still_reports(tmp_path: Path) -> None:
    _, out = _lease(tmp_path, "1")
    report = json.loads((out / "gpu-lease.json").read_text())
    assert report["finished"]
    assert all(s["status"] == "skipped" and s["reason"].startswith("deadline") for s in report["steps"])


def test_the_gpu_tests_are_every_file_that_touches_cuda(scripts: dict[str, ModuleType]) -> None:
    files = set(scripts["lease"].gpu_test_files())
    assert {"tests/kernels/test_attention_backends.py", "tests/kernels/test_flashinfer_backend.py",
            "tests/quant/test_linear.py", "tests/spec_decode/test_speculative_sampling.py",
            "tests/spec_decode/test_verify.py", "tests/kv_transfer/test_cuda_ipc.py",
            "tests/kv_transfer/test_nccl.py"} <= files
    assert not any(f.endswith("conftest.py") for f in files)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_required_gpu_turns_a_missing_cuda_into_a_failure() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/kernels/test_flashinfer_backend.py::test_flashinfer_cacheless_prefill"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**env, "TANDEM_TEST_REQUIRE_GPU": "1"})
    assert done.returncode == 1, done.stdout[-2000:]
    # The `gpu` mark's skip comes at set-up: pytest counts a set-up failure as an error.
    assert "1 error" in done.stdout and "skipped" not in done.stdout
    assert "TANDEM_TEST_REQUIRE_GPU=1 and a GPU piece is missing: Skipped: needs CUDA" in done.stdout


def test_random_weights_fill_a_tandem_model(tmp_path: Path, scripts: dict[str, ModuleType]) -> None:
    from common.model.loader import iter_weights, load_skeleton, load_weights

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    written = scripts["worker"].write_random_weights(tmp_path, "cpu", shard_bytes=20_000)
    assert written == sum(n * 2 for n in (t.numel() for _, t in iter_weights(tmp_path)))
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # sharded, with an index
    model = load_skeleton(tmp_path, torch.bfloat16).to_empty(device="cpu")
    load_weights(model, iter_weights(tmp_path))  # every parameter filled, every name and shape known


def test_the_bundle_size_check_refuses_an_oversized_folder(tmp_path: Path, scripts: dict[str, ModuleType],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "big.whl").write_bytes(b"\0" * (2 << 20))
    main = scripts["bundle"].main
    assert main(["--out", str(tmp_path), "--check-size", "--limit-mib", "1"]) == 1
    assert "2.0 MiB in 1 files (limit 1 MiB): OVER THE LIMIT" in capsys.readouterr().out
    assert main(["--out", str(tmp_path), "--check-size", "--limit-mib", "3"]) == 0
    assert "OVER" not in capsys.readouterr().out
    assert main(["--out", str(tmp_path / "absent"), "--check-size"]) == 1


def test_test_outcomes_are_counted_from_junit_or_from_a_killed_runs_lines(tmp_path: Path,
                                                                         scripts: dict[str, ModuleType]) -> None:
    junit_summary, log_summary = scripts["report"].junit_summary, scripts["report"].log_summary
    lines = ["tests/a.py::test_one ", "[gw1] [ 33%] PASSED tests/a.py::test_one ",
             "[gw0] [ 66%] FAILED tests/a.py::test_two[cuda] ",
             "tests/b.py::test_three SKIPPED (needs two GPUs) [100%]",
             "FAILED tests/a.py::test_two[cuda] - AssertionError"]  # the closing summary: not counted again
    assert log_summary("\n".join(lines)) == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1,
                                             "failed_tests": ["tests/a.py::test_two[cuda]"]}
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/><testcase classname="a" name="bad"><failure/>'
        '</testcase><testcase classname="b" name="s1"><skipped message="NCCL pairs need two GPUs"/></testcase>'
        '<testcase classname="b" name="s2"><skipped message="NCCL pairs need two GPUs"/></testcase>'
        '</testsuite></testsuites>')
    summary = junit_summary(tmp_path / "junit.xml")
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (1, 1, 2)
    assert summary["failed_tests"] == ["a::bad"] and summary["skip_reasons"] == {"NCCL pairs need two GPUs": 2}


def test_a_piece_the_bundle_lacks_is_skipped_with_the_bundles_reason(tmp_path: Path,
                                                                     scripts: dict[str, ModuleType]) -> None:
    bundle = _fake_bundle(tmp_path / "b")
    (bundle / "models" / "llama3-8b" / "config.json").unlink()
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["missing"].append({"item": "models", "reason": "the bundled SmolLM2 is not here"})
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "out").mkdir()
    lease = scripts["lease"].Lease(tmp_path / "out", 100, bundle, tmp_path / "scratch")
    (tmp_path / "scratch" / "logs").mkdir(parents=True)
    steps = {s.name: s for s in lease.steps}
    lease.run_step(steps["install"])
    lease.facts = {"cuda_available": True}  # as if on the GPU: the bundle, not the machine, decides these two
    for name in ("flashinfer-warmup", "e2e-8b"):
        lease.run_step(steps[name])
    assert steps["flashinfer-warmup"].status == "skipped"
    assert steps["flashinfer-warmup"].reason == "flashinfer-python not in the bundle: left out of this test's bundle"
    assert steps["e2e-8b"].status == "skipped"
    assert steps["e2e-8b"].reason == "no models/llama3-8b/config.json in the bundle: the bundled SmolLM2 is not here"
