"""The GPU lease bundle (`make gpu-bundle`): what the lent GPU machine lacks to run Tandem's GPU tests and
measurements offline, in one git-ignored folder that travels with the working tree (`carry`).

    python scripts/gpu_bundle.py [--out gpu-bundle] [--limit-mib 40] [--check-size]

The lent machine (library device docs: an H200 image with Python 3.12, torch 2.11+cu130, triton 3.6, no
network) runs `scripts/gpu-lease.sh`, which installs this folder with pip --no-index. It holds:
- wheels/: Python 3.12 manylinux x86_64 wheels of what the image lacks: Tandem's runtime dependencies that
  are not among the image's packages (IMAGE_PACKAGES, read off that image), grpcio and protobuf at
  requirements/dev.lock's pins (the image has both at versions nobody has read; the stubs need these
  floors), and FlashInfer 0.6.0 with apache-tvm-ffi 0.1.6 (9.5 MB; 0.7.x pulls ~238 MB). Versions come from
  requirements/dev.lock; constraints.txt pins the same files for the install there;
- stubs/tandem/v1/: the protobuf and gRPC stubs, generated here by grpc_tools (there is none there);
- models/: the tokenizer of the bundled SmolLM2-135M-Instruct and the config.json of a SmolLM2-shaped and
  a Llama-3-8B-shaped model; the lease generates their random weights on the GPU (never carried);
- manifest.json: what is here, what is missing and why.
Every pip call passes requirements/constraints-cpu.txt, as every pip call on this machine does. It prints
the bundle's size and exits 1 above the limit (the working tree and the bundle travel in 64 MiB together).
--check-size only measures an existing folder.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "requirements" / "constraints-cpu.txt"
LOCK = ROOT / "requirements" / "dev.lock"
LIMIT_MIB = 40.0

# The device image's Python packages (library device docs, KINDS.md, read on 2026-11-17): carried only for
# another version. Names normalized (PEP 503).
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp
""".split())  # noqa: SIM905
# In the image, but at versions nobody has read there: the stubs generated here check these floors at import.
FORCED = ("grpcio", "protobuf")
# The GPU extra at the version that fits (flashinfer-python 0.7.x: ~238 MB with what it imports). FlashInfer
# imports apache-tvm-ffi and the image's nvidia-ml-py; cudnn-frontend and cutlass-dsl only for other kernels.
GPU_PINS = {"flashinfer-python": "0.6.0", "apache-tvm-ffi": "0.1.6"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Llama-3-8B's shape (32 layers, 4096 wide, 32 query / 8 KV heads of 128) over the SmolLM2 tokenizer's vocabulary.
LLAMA3_8B_SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[normalize(name)] = version.strip()
    return pins


def carried_packages() -> dict[str, str]:
    """name -> version: Tandem's runtime closure outside the image, plus FORCED and GPU_PINS.

    Read from the installed tandem-serve's metadata (this venv); the walk stops at the image's packages,
    whose own needs the image meets.
    """
    import importlib.metadata as md

    from packaging.requirements import Requirement

    pins = lock_pins()
    environment = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    wanted: set[str] = set(FORCED)
    todo = ["tandem-serve"]
    while todo:
        name = todo.pop()
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            dep = normalize(req.name)
            if (req.marker and not req.marker.evaluate(environment)) or dep in wanted or dep in IMAGE_PACKAGES:
                continue
            wanted.add(dep)
            todo.append(dep)
    missing_pins = sorted(wanted - set(pins))
    if missing_pins:
        raise SystemExit(f"gpu-bundle: no pin in {LOCK.relative_to(ROOT)} for {missing_pins}")
    return {**{name: pins[name] for name in sorted(wanted)}, **GPU_PINS}


def _wheel_file(wheels: Path, name: str, version: str) -> Path | None:
    stem = f"{normalize(name).replace('-', '_')}-{version}-"
    return next((p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem.lower())), None)


def download_wheels(wheels: Path, packages: dict[str, str]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    wheels.mkdir(parents=True, exist_ok=True)
    keep: set[Path] = set()
    got: list[dict[str, Any]] = []
    missing: list[dict[str, str]] = []
    for name, version in packages.items():
        path = _wheel_file(wheels, name, version)
        if path is None:
            platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                 "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms,
                 "-c", str(CONSTRAINTS), "-d", str(wheels), f"{name}=={version}"],
                capture_output=True, text=True, timeout=600)
            path = _wheel_file(wheels, name, version)
            if done.returncode != 0 or path is None:
                reason = (done.stderr.strip().splitlines() or ["pip download failed"])[-1][:300]
                missing.append({"item": f"{name}=={version}", "reason": reason})
                print(f"gpu-bundle: {name}=={version}: NOT OBTAINED offline here: {reason}")
                continue
        keep.add(path)
        got.append({"name": name, "version": version, "file": path.name, "bytes": path.stat().st_size})
    for stale in set(wheels.glob("*.whl")) - keep:  # two versions of one package stop the install there
        stale.unlink()
    return got, missing


def wheel_requirements(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def unmet_requirements(wheels: Path, got: list[dict[str, Any]]) -> list[str]:
    """Requirements of the carried wheels that neither the bundle nor the image meets (flashinfer's optional
    kernel libraries among them: they are listed, not carried)."""
    from packaging.requirements import Requirement

    carried = {normalize(w["name"]) for w in got}
    unmet = []
    for wheel in got:
        for line in wheel_requirements(wheels / wheel["file"]):
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"python_version": "3.12", "sys_platform": "linux",
                                                        "platform_machine": "x86_64", "extra": ""}):
                continue
            if normalize(req.name) not in carried | IMAGE_PACKAGES:
                unmet.append(f"{wheel['name']} needs {req}")
    return unmet


def generate_stubs(stubs: Path) -> dict[str, Any]:
    """tandem/v1 stubs from protos/ with this venv's grpc_tools, and the runtime floors they check."""
    shutil.rmtree(stubs, ignore_errors=True)
    (stubs / "tandem" / "v1").mkdir(parents=True)
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos" / "tandem" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={stubs}",
                    f"--grpc_python_out={stubs}", *protos], cwd=ROOT, check=True, timeout=120)
    for package in ("tandem", "tandem/v1"):
        shutil.copy(ROOT / package / "__init__.py", stubs / package / "__init__.py")
    generated = (stubs / "tandem" / "v1").glob("*_pb2*.py")
    text = "\n".join(p.read_text() for p in generated)
    protobuf = re.search(r"# Protobuf Python Version: ([\d.]+)", text)
    grpc = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", text)
    return {"files": len(list((stubs / "tandem" / "v1").glob("*.py"))),
            "needs_protobuf": protobuf.group(1) if protobuf else None, "needs_grpcio": grpc.group(1) if grpc else None}


def model_configs(models: Path) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The bundled SmolLM2's tokenizer (converted here from its GGUF) and two configs; no weights."""
    from common.config.settings import default_home
    from common.model.model_store import DEFAULT_MODEL, resolve_model

    try:
        source = resolve_model(DEFAULT_MODEL, default_home(), progress=False)
    except (FileNotFoundError, ValueError) as exc:
        return {}, [{"item": "models", "reason": f"the bundled SmolLM2 is not here: {exc}"}]
    shutil.rmtree(models, ignore_errors=True)
    (models / "tokenizer").mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, models / "tokenizer" / name)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"  # the lease generates bf16 weights
    shapes = {"smollm2-135m": config,
              "llama3-8b": {**{k: v for k, v in config.items() if k != "rope_parameters"}, **LLAMA3_8B_SHAPE}}
    for name, shape in shapes.items():
        (models / name).mkdir()
        (models / name / "config.json").write_text(json.dumps(shape, indent=2) + "\n")
    return {name: f"models/{name}" for name in shapes} | {"tokenizer": "models/tokenizer"}, []


def folder_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def check_size(path: Path, limit_mib: float) -> bool:
    size, count = folder_size(path)
    over = size > limit_mib * 2**20
    print(f"gpu-bundle: {path} holds {size / 2**20:.1f} MiB in {count} files (limit {limit_mib:g} MiB)"
          + (": OVER THE LIMIT" if over else ""))
    return not over


def build(out: Path) -> dict[str, Any]:
    started = time.monotonic()
    packages = carried_packages()
    got, missing = download_wheels(out / "wheels", packages)
    (out / "constraints.txt").write_text("".join(f"{w['name']}=={w['version']}\n" for w in got))
    stubs = generate_stubs(out / "stubs")
    versions = {normalize(w["name"]): w["version"] for w in got}
    for package, floor in (("protobuf", stubs["needs_protobuf"]), ("grpcio", stubs["needs_grpcio"])):
        have = versions.get(package)
        if floor and have and tuple(map(int, have.split(".")[:3])) < tuple(map(int, floor.split("."))):
            missing.append({"item": f"{package}>={floor}",
                            "reason": f"the bundle carries {have}, the stubs need {floor}"})
    models, model_missing = model_configs(out / "models")
    unmet = unmet_requirements(out / "wheels", got)
    missing += model_missing
    manifest = {"made_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": "3.12",
                "platform": "manylinux x86_64", "wheels": got, "unmet_requirements": unmet, "stubs": stubs,
                "models": models, "missing": missing}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for item in missing:
        print(f"gpu-bundle: missing {item['item']}: {item['reason']}")
    for line in unmet:
        print(f"gpu-bundle: not carried (not needed to import): {line}")
    print(f"gpu-bundle: {len(got)} wheels, {stubs['files']} stub files, {len(models)} model folders "
          f"in {time.monotonic() - started:.0f}s")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-bundle")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    parser.add_argument("--check-size", action="store_true", help="only measure an existing bundle")
    args = parser.parse_args(argv)
    if not args.check_size:
        build(args.out)
    elif not args.out.is_dir():
        print(f"gpu-bundle: no folder {args.out}", file=sys.stderr)
        return 1
    return 0 if check_size(args.out, args.limit_mib) else 1


if __name__ == "__main__":
    sys.exit(main())
