"""The Kubernetes manifests run for real by `podman kube play` (scripts/k8s-smoke.sh), where podman can.

The smoke run skips itself unless podman is installed, the image (``TANDEM_SMOKE_IMAGE``, default
``tandem:cpu``) exists, and podman can start a container of it here (a sandbox that forbids a container's
rlimits or cgroups cannot; scripts/k8s-smoke.sh says how to configure podman there). The adapter that makes up
for what podman is not (scripts/k8s_podman.py) is checked everywhere: it changes only what it says it does.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.test_kubernetes import render

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import k8s_podman  # noqa: E402  (scripts/ is no package)

IMAGE = os.environ.get("TANDEM_SMOKE_IMAGE", "tandem:cpu")


def _strip(obj: Any) -> Any:
    """``obj`` without what the adapter may change."""
    obj = copy.deepcopy(obj)
    pod = obj["spec"]["template"]["spec"]
    pod.pop("hostAliases", None)
    pod["volumes"] = [v for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") != "Memory"]
    for c in pod["containers"]:
        c.pop("ports", None)
        c["volumeMounts"] = [m for m in c.get("volumeMounts", []) if m["name"] != "dshm"]
        c["env"] = [v for v in c.get("env", []) if v["name"] != "TANDEM_ADVERTISE_HOST"]
    return obj


def test_the_podman_adapter_changes_only_what_it_says() -> None:
    docs = render("overlays/cpu")
    plays = k8s_podman.adapt(copy.deepcopy(docs))
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert [objs[-1]["metadata"]["name"] for _, objs in plays] == ["tandem-gateway", "tandem-prefill",
                                                                    "tandem-decode"]
    ips = [ip for ip, _ in plays]
    assert len(set(ips)) == 3
    for ip, objs in plays:
        *configmaps, deployment = objs
        assert configmaps == [d for d in docs if d["kind"] == "ConfigMap"]
        assert _strip(deployment) == _strip(deployments[deployment["metadata"]["name"]])
        pod = deployment["spec"]["template"]["spec"]
        env = {v["name"]: v for v in pod["containers"][0]["env"]}
        if "TANDEM_ADVERTISE_HOST" in env:
            assert env["TANDEM_ADVERTISE_HOST"] == {"name": "TANDEM_ADVERTISE_HOST", "value": ip}
        # Cluster DNS: each Service name resolves to the gateway pod's address.
        assert pod["hostAliases"] == [{"ip": ips[0], "hostnames": ["tandem-gateway", "tandem-gateway-internal"]}]


def _podman_can_run() -> str:
    """Why the smoke run cannot run here, or "" when it can."""
    if not shutil.which("podman"):
        return "podman is not installed"
    if subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True, timeout=60).returncode != 0:
        return f"no image {IMAGE} (podman build -t tandem:cpu .)"
    probe = subprocess.run(["podman", "run", "--rm", "--network", "none", "--entrypoint", "true", IMAGE],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"podman cannot start a container here: {probe.stderr.strip()[-300:]}"
    return ""


@pytest.mark.docker
@pytest.mark.slow
def test_smoke_run_with_podman_kube_play() -> None:
    why = _podman_can_run()
    if why:
        pytest.skip(why)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "k8s-smoke.sh")], capture_output=True, text=True,
                         timeout=1200, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert ">> k8s-smoke: passed" in out.stdout
