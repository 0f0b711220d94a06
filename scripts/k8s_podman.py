"""Turn rendered Kubernetes manifests (deploy/kubernetes, `kubectl kustomize`) into what `podman kube play` runs.

Podman plays Pods and Deployments but is no cluster: it has no Services (no cluster DNS), no downward API for
`status.podIP`, and runs neither probes of the gRPC kind nor preStop hooks. scripts/k8s-smoke.sh therefore
plays the manifests' Deployments as they are rendered, with only these changes, each one what the cluster
would provide:

- each pod gets a fixed address on the smoke network (IPS below; `podman kube play --ip`, in this order),
  and `status.podIP` becomes that address;
- each Service name becomes a host alias of the pods its selector picks (what cluster DNS resolves);
- Services and PodDisruptionBudgets are left out (nothing to play), and so is the /dev/shm emptyDir of
  medium Memory (podman mounts its own /dev/shm);
- containerPorts are dropped: podman before 4.6 publishes every one of them on the host (a kubelet publishes
  none), and every pod here has the same metrics port. The pods reach each other on the smoke network.

Reads YAML on stdin; writes one file per Deployment, in play order (the gateway first), into the folder named by
the first argument, and prints `<file> <ip>` lines.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

SUBNET = "10.89.77"
ORDER = ("gateway", "prefill", "decode")
IPS = {role: f"{SUBNET}.{10 + i}" for i, role in enumerate(ORDER)}


def component(obj: dict[str, Any]) -> str:
    return obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(service: dict[str, Any], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def adapt(docs: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    configmaps = [d for d in docs if d["kind"] == "ConfigMap"]
    services = [d for d in docs if d["kind"] == "Service"]
    deployments = sorted((d for d in docs if d["kind"] == "Deployment"), key=lambda d: ORDER.index(component(d)))
    aliases: dict[str, list[str]] = {}
    for service in services:
        for deployment in deployments:
            if selects(service, deployment):
                aliases.setdefault(IPS[component(deployment)], []).append(service["metadata"]["name"])
    out = []
    for deployment in deployments:
        ip = IPS[component(deployment)]
        pod = deployment["spec"]["template"]["spec"]
        pod["hostAliases"] = [{"ip": a, "hostnames": names} for a, names in sorted(aliases.items())]
        pod["volumes"] = [v for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") != "Memory"]
        kept = {v["name"] for v in pod["volumes"]}
        for c in pod["containers"]:
            c.pop("ports", None)
            c["volumeMounts"] = [m for m in c.get("volumeMounts", []) if m["name"] in kept]
            for var in c.get("env", []):
                if var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                    del var["valueFrom"]
                    var["value"] = ip
        out.append((ip, [*configmaps, deployment]))
    return out


def main() -> int:
    folder = Path(sys.argv[1])
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    for i, (ip, objs) in enumerate(adapt(docs)):
        path = folder / f"{i}-{component(objs[-1])}.yaml"
        path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
        print(path, ip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
