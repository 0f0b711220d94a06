#!/usr/bin/env bash
# Smoke-run the plain Kubernetes manifests (deploy/kubernetes/overlays/cpu) with `podman kube play`: the
# gateway, one prefill and one decode pod as rendered by kustomize, the nodes joining the gateway's live
# membership through the Service name, a generation long enough to cross from the prefill pod to the decode
# pod, and the decode pod's preStop hook (`tandem drain`) run as the kubelet would before it stops the pod,
# with a stream in flight that must complete.
#
#   podman build -t tandem:cpu .            # the image (Dockerfile; BASE_IMAGE=... where no registry answers)
#   bash scripts/k8s-smoke.sh               # exit 0: every step passed; the pods are removed either way
#
# What podman is not (no Services, no status.podIP, no gRPC probes, no preStop hooks) is made up for by
# scripts/k8s_podman.py, which says exactly what it changes. Knobs: TANDEM_SMOKE_IMAGE (default tandem:cpu),
# TANDEM_SMOKE_NETWORK (tandem-smoke, created with the adapter's subnet), TANDEM_SMOKE_TIMEOUT_S (600: the
# nodes' model load; minutes on a small CPU). Where podman cannot set container rlimits or cgroups (a
# sandbox), point CONTAINERS_CONF at a containers.conf that lowers default_ulimits and picks a runtime that
# works there (docs/multi-machine.md#kubernetes).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${TANDEM_SMOKE_IMAGE:-tandem:cpu}
NETWORK=${TANDEM_SMOKE_NETWORK:-tandem-smoke}
TIMEOUT_S=${TANDEM_SMOKE_TIMEOUT_S:-600}
PYTHON=${PYTHON:-.venv/bin/python}
if [[ -x .venv/bin/kubectl ]]; then KUBECTL=.venv/bin/kubectl; else KUBECTL=kubectl; fi

say() { echo ">> k8s-smoke: $*"; }
fail() { echo "k8s-smoke: FAILED: $*" >&2; exit 1; }

command -v podman >/dev/null || { echo "k8s-smoke: podman is not installed" >&2; exit 2; }
podman image exists "$IMAGE" || { echo "k8s-smoke: no image $IMAGE: podman build -t tandem:cpu ." >&2; exit 2; }

work=$(mktemp -d)
played=()
cleanup() {
    local i
    for ((i = ${#played[@]} - 1; i >= 0; i--)); do
        podman kube down "${played[i]}" >/dev/null 2>&1 || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

subnet=$("$PYTHON" -c 'import sys; sys.path.insert(0, "scripts"); import k8s_podman; print(k8s_podman.SUBNET)')
podman network exists "$NETWORK" || podman network create --subnet "$subnet.0/24" "$NETWORK" >/dev/null

say "rendering deploy/kubernetes/overlays/cpu ($KUBECTL kustomize)"
"$KUBECTL" kustomize deploy/kubernetes/overlays/cpu >"$work/rendered.yaml"
sed "s#image: tandem:cpu#image: $IMAGE#" "$work/rendered.yaml" | "$PYTHON" scripts/k8s_podman.py "$work" >"$work/plan"

while read -r file ip; do
    say "podman kube play $(basename "$file") (pod address $ip)"
    podman kube play --network "$NETWORK" --ip "$ip" "$file" >/dev/null
    played+=("$file")
done <"$work/plan"

# The Tandem container of a role's pod (podman names it <pod>-<container>; the infra container is skipped).
container_of() {
    local pod
    pod=$(podman pod ps --filter "label=app.kubernetes.io/component=$1" --format '{{.Name}}' | head -n1)
    [[ -n $pod ]] || fail "no pod for $1"
    podman ps -a --filter "pod=$pod" --format '{{.Names}}' | grep -v -- '-infra$' | head -n1
}
gateway=$(container_of gateway)
prefill=$(container_of prefill)
decode=$(container_of decode)

# What the probes ask, asked the same way: gRPC health of each server's own service.
wait_healthy() {  # container port service
    local deadline=$((SECONDS + TIMEOUT_S))
    until podman exec "$1" tandem health --target "127.0.0.1:$2" --service "$3" >/dev/null 2>&1; do
        [[ $(podman inspect -f '{{.State.Running}}' "$1") == true ]] || { podman logs --tail 30 "$1" >&2; fail "$1 exited"; }
        ((SECONDS < deadline)) || { podman logs --tail 30 "$1" >&2; fail "$1 not SERVING within ${TIMEOUT_S}s"; }
        sleep 3
    done
    say "$1 SERVING ($3)"
}
http_health() {  # the gateway's readiness probe: GET /health
    podman exec "$gateway" python -c 'import sys, urllib.request
try:
    urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=3)
except Exception as exc:
    print(exc); sys.exit(1)'
}
wait_healthy "$gateway" 50051 tandem.v1.Tandem
wait_healthy "$prefill" 50061 tandem.v1.Prefill
wait_healthy "$decode" 50071 tandem.v1.Decode

deadline=$((SECONDS + 60))
until http_health >/dev/null; do
    ((SECONDS < deadline)) || { podman logs --tail 30 "$gateway" >&2; fail "the gateway never became ready (no node registered)"; }
    sleep 2
done
say "gateway ready: both nodes registered through tandem-gateway-internal:50052"

say "a short chat (prefilled on the decode pod) and a 400-word prompt (prefill pod -> KV -> decode pod)"
podman exec "$gateway" tandem generate --url 127.0.0.1:50051 --chat --prompt "Say hello." --max-tokens 8 \
    || fail "short generation"
long=$(printf 'word %.0s' $(seq 400))
podman exec "$gateway" tandem generate --url 127.0.0.1:50051 --prompt "$long" --max-tokens 8 --ignore-eos \
    || fail "long generation"
sent=$(podman exec "$prefill" python -c 'import urllib.request
text = urllib.request.urlopen("http://127.0.0.1:9400/metrics", timeout=3).read().decode()
print(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("tandem:kv_transfer_bytes_total")))')
say "prefill pod's /metrics: tandem:kv_transfer_bytes_total = $sent (KV sent to the decode pod)"

# Scale-down as the kubelet does it: the preStop hook's command (from the manifest), then the pod stops.
hook=$("$PYTHON" - "$work/rendered.yaml" <<'EOF'
import shlex, sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "tandem-decode":
        print(shlex.join(doc["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]))
EOF
)
# A stream in flight when the hook runs: the drain waits for it, and it completes.
podman exec "$gateway" tandem generate --url 127.0.0.1:50051 --prompt "Count to one hundred:" --max-tokens 160 \
    --ignore-eos >"$work/inflight.txt" 2>&1 &
inflight=$!
sleep 2
say "decode preStop, one 160-token stream in flight: $hook"
out=$(eval "podman exec $decode $hook" 2>&1)
echo "$out"
grep -q "drained in" <<<"$out" || fail "the drain did not report the node drained"
wait "$inflight" || { cat "$work/inflight.txt" >&2; fail "the stream in flight during the drain failed"; }
tail -n1 "$work/inflight.txt"
grep -q "^\[160 tokens" "$work/inflight.txt" || fail "the stream in flight during the drain did not complete"
http_health >/dev/null && fail "the gateway still reports ready with its only decode node drained"
say "gateway not ready with no decode node, as the readiness probe would see"

say "passed"
