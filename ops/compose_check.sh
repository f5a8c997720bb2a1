#!/usr/bin/env bash
# The container stack, started for real on a machine with Docker and no image registry:
#
#   apt-get install docker.io debootstrap    # and docker-compose, where no compose v2 plugin exists
#   bash ops/compose_check.sh
#
# 1. builds the images: the Debian base (ops/build_base_image.sh, only when missing), pagedkv:cpu
#    on it from a wheelhouse this machine's pip downloads (torch's CPU wheel included), Prometheus
#    from Debian's package; checks that the CPU image holds no CUDA library;
# 2. starts the control plane, a worker and Prometheus as separate containers (docker-compose.yml
#    + ops/docker-compose.local.yml: host networking, everything on 127.0.0.1) with stories260K
#    mounted read-only, and waits for /health;
# 3. serves the stories260K golden (PROVENANCE.md) through the container's API;
# 4. confirms Prometheus scrapes every pagedkv metric the Grafana dashboard queries (its HTTP API);
# 5. kills the worker's process (as the OOM killer would) and reports what the stack does;
# 6. tears everything down and checks that no container is left.
# It starts dockerd if none answers, and stops it at the end. Not part of .ci/run (it takes minutes).
#
# Environment: BASE_IMAGE (pagedkv-base:bookworm), PAGEDKV_STORIES260K (../shared/models/stories260K),
# WHEELHOUSE (1; 0: the build reaches PyPI and PyTorch's CPU index itself), WHEELHOUSE_DIR
# (~/.cache/pagedkv/wheelhouse, kept between runs), WHEEL_PORT (8765).
# Host ports 8000, 5555 and 9090 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$SECONDS
say() { printf '[%4ds] %s\n' $((SECONDS - T0)) "$*"; }
fail() { say "FAIL: $*"; exit 1; }
phase() { say "== $*"; PHASE_T=$SECONDS; }
took() { say "   $1: $((SECONDS - PHASE_T)) s"; }

PROJECT=pagedkv-check
export BASE_IMAGE=${BASE_IMAGE:-pagedkv-base:bookworm}
MODEL_DIR=$(cd "${PAGEDKV_STORIES260K:-$ROOT/../shared/models/stories260K}" && pwd)
API=http://127.0.0.1:8000
PROM=http://127.0.0.1:9090
WORK=$(mktemp -d /tmp/pagedkv-compose-check.XXXXXX)
DOCKERD_PID="" WHEEL_PID=""

cleanup() {
    local rc=$?
    trap - EXIT
    if [ -n "${COMPOSE:-}" ]; then
        phase "teardown"
        "${COMPOSE[@]}" down --volumes --remove-orphans --timeout 10 2>&1 | sed 's/^/   /' || true
        left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" 2>/dev/null || true)
        if [ -n "$left" ]; then say "FAIL: containers left: $left"; rc=1; else say "   every container removed"; fi
        took "teardown"
    fi
    [ -n "$WHEEL_PID" ] && kill "$WHEEL_PID" 2>/dev/null || true
    if [ -n "$DOCKERD_PID" ]; then
        kill "$DOCKERD_PID" 2>/dev/null && wait "$DOCKERD_PID" 2>/dev/null || true
        say "   dockerd (started by this script) stopped"
    fi
    rm -rf "$WORK"
    say "exit $rc after $((SECONDS - T0)) s"
    exit $rc
}
trap cleanup EXIT

# ---- Docker -------------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || fail "no Docker daemon: apt-get install docker.io"
    say "starting dockerd (log: $WORK/dockerd.log)"
    dockerd >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; fail "dockerd did not answer within 60 s"; }
fi
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE=(docker-compose)
else
    fail "no docker compose: install the compose v2 plugin or Debian's docker-compose"
fi
say "docker $(docker version -f '{{.Server.Version}}'), $("${COMPOSE[@]}" version | head -1)"
COMPOSE+=(-p "$PROJECT" -f docker-compose.yml -f ops/docker-compose.local.yml)
for port in 8000 5555 9090; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then fail "127.0.0.1:$port is in use (host networking needs it)"; fi
done

# the stories260K checkpoint's folder, mounted read-only at /models in both pagedkv containers
export MODELS_DIR=$(dirname "$MODEL_DIR") MODEL=/models/$(basename "$MODEL_DIR")
# the worker-channel secret: fresh for this run, handed to both containers through the environment
# by docker-compose.yml (never written into an image)
PAGEDKV_WORKER_SECRET=${PAGEDKV_WORKER_SECRET:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
export PAGEDKV_WORKER_SECRET
export PAGEDKV_ARGS="--swap-space 0.25 --cpu-kv-cache-space 0.25"

# ---- the wheelhouse: torch's CPU wheel and every dependency, from this machine's pip ---------------
# This machine's pip knows where packages are (its config: PyPI through a proxy, local indexes, a
# local wheel folder); a container does not. So this pip downloads the wheels for the image's
# Python, and the build installs them from 127.0.0.1 with no index (WHEELHOUSE_URL).
if [ "${WHEELHOUSE:-1}" = 1 ]; then
    phase "wheelhouse: torch (CPU) and pagedkv's dependencies, by this machine's pip"
    torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' ops/Dockerfile)
    python3 -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.match(r"[\w.-]+", d).group().lower() not in ("torch", "triton")))' >"$WORK/requirements.txt"
    wheels=${WHEELHOUSE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedkv/wheelhouse}  # kept between runs
    mkdir -p "$wheels"
    echo "torch==$torch_version+cpu" >>"$WORK/requirements.txt"
    # the same requirements as the last run that completed: nothing to resolve or download
    if ! cmp -s "$WORK/requirements.txt" "$wheels/.requirements.txt"; then
        python3 -m pip download --dest "$wheels" --only-binary=:all: --python-version 3.11 \
            -r "$WORK/requirements.txt" "setuptools>=68" >"$WORK/wheelhouse.log" 2>&1 \
            || { grep -v 'is ignored' "$WORK/wheelhouse.log" | tail -20
                 fail "pip download (torch $torch_version+cpu: add PyTorch's CPU index with PIP_EXTRA_INDEX_URL where pip has no CPU wheel)"; }
        cp "$WORK/requirements.txt" "$wheels/.requirements.txt"
    fi
    say "   $wheels: $(ls "$wheels" | wc -l) wheels, $(du -sh "$wheels" | cut -f1), $(cd "$wheels" && ls torch-*.whl)"
    port=${WHEEL_PORT:-8765}
    python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >"$WORK/wheels-http.log" 2>&1 &
    WHEEL_PID=$!
    export WHEELHOUSE_URL=http://127.0.0.1:$port/
    took "wheelhouse"
else
    say "WHEELHOUSE=0: the build uses PyPI and PyTorch's CPU index"
fi

# ---- 1. images ----------------------------------------------------------------------------------
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    [[ "$BASE_IMAGE" == pagedkv-base:* ]] || fail "base image $BASE_IMAGE is missing"
    phase "build $BASE_IMAGE (debootstrap)"
    bash ops/build_base_image.sh --suite "${BASE_IMAGE#pagedkv-base:}" >"$WORK/base.log" 2>&1 \
        || { tail -30 "$WORK/base.log"; fail "ops/build_base_image.sh"; }
    took "base image build"
fi
phase "build pagedkv:cpu on $BASE_IMAGE"
"${COMPOSE[@]}" build --force-rm control-plane >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; fail "pagedkv image build"; }
say "   $(grep -c 'Using cache' "$WORK/build.log" || true) of $(grep -c '^Step ' "$WORK/build.log" || true) build steps from the layer cache"
took "pagedkv:cpu build"
phase "build pagedkv-prometheus:local (Debian's prometheus package)"
"${COMPOSE[@]}" build --force-rm prometheus >"$WORK/build-prom.log" 2>&1 || { tail -40 "$WORK/build-prom.log"; fail "Prometheus image build"; }
took "prometheus build"
docker image ls --format '   {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E 'pagedkv' || true

phase "the CPU image holds no CUDA library"
cuda=$(docker run --rm --network none --entrypoint sh pagedkv:cpu -c '
    find / -xdev \( -name "libcu*.so*" -o -name "libnv*.so*" -o -name "libcudnn*" -o -name "libnccl*" -o -name ptxas \) -print 2>/dev/null
    pip list --format=freeze 2>/dev/null | grep -iE "^(nvidia-|triton|cuda-)" || true')
docker run --rm --network none --entrypoint python pagedkv:cpu -c \
    'import torch; print("   torch", torch.__version__, "CUDA build:", torch.version.cuda, "available:", torch.cuda.is_available())'
[ -z "$cuda" ] || { echo "$cuda"; fail "CUDA libraries or packages in pagedkv:cpu"; }
say "   none: find libcu*/libnv*/libcudnn*/libnccl*/ptxas and pip nvidia-*/triton/cuda-* all empty"

# ---- 2. start -----------------------------------------------------------------------------------
phase "start control-plane, worker, prometheus (host network, 127.0.0.1)"
"${COMPOSE[@]}" up -d --no-build --no-deps control-plane worker prometheus 2>&1 | sed 's/^/   /'
health() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$API/health" || true; }
for _ in $(seq 300); do [ "$(health)" = 200 ] && break; sleep 1; done
[ "$(health)" = 200 ] || { "${COMPOSE[@]}" logs --tail 30; fail "/health did not answer 200 within 300 s"; }
took "start to /health 200"
"${COMPOSE[@]}" ps | sed 's/^/   /'

# ---- 3. the golden ------------------------------------------------------------------------------
# Prints the completion and exits 1 unless it is the greedy golden of PROVENANCE.md.
golden() {
    python3 - "$MODEL_DIR/PROVENANCE.md" "$API" <<'EOF'
import json, re, sys, urllib.error, urllib.request
provenance, api = sys.argv[1], sys.argv[2]
want = json.loads(re.search(r'The 60 new tokens alone decode to `("(?:[^"\\]|\\.)*")`', open(provenance).read()).group(1))
model = json.load(urllib.request.urlopen(f"{api}/v1/models", timeout=10))["data"][0]["id"]
body = {"model": model, "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0}
req = urllib.request.Request(f"{api}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
try:
    out = json.load(urllib.request.urlopen(req, timeout=120))
except urllib.error.HTTPError as e:
    print(f"   HTTP {e.code}: {e.read().decode()[:300]}")
    sys.exit(1)
choice = out["choices"][0]
print(f"   model {model}: {out['usage']['completion_tokens']} tokens, finish_reason {choice['finish_reason']}")
print(f"   text {json.dumps(choice['text'])}")
ok = choice["text"] == want and out["usage"]["completion_tokens"] == 60
print("   equals the golden of PROVENANCE.md" if ok else f"   DIFFERS from the golden {json.dumps(want)}")
sys.exit(0 if ok else 1)
EOF
}
phase "serve the stories260K golden through the container's API"
golden || fail "the golden"
took "golden request"

# ---- 4. Prometheus ------------------------------------------------------------------------------
phase "Prometheus scrapes every pagedkv metric the dashboard queries"
python3 - "$PROM" ops/grafana/dashboards/pagedkv.json <<'EOF' || fail "Prometheus"
import json, re, sys, time, urllib.parse, urllib.request
prom, dashboard = sys.argv[1], sys.argv[2]

def query(q):
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    return json.load(urllib.request.urlopen(url, timeout=10))["data"]["result"]

deadline = time.monotonic() + 90
while True:  # a scrape after the golden request: its 60 tokens are counted
    try:
        done = any(float(r["value"][1]) >= 60 for r in query("pagedkv:generation_tokens_total"))
    except OSError:
        done = False
    if done:
        break
    if time.monotonic() > deadline:
        sys.exit("   no scrape counted the golden's 60 tokens within 90 s")
    time.sleep(1)
targets = json.load(urllib.request.urlopen(f"{prom}/api/v1/targets", timeout=10))["data"]["activeTargets"]
for t in targets:
    print(f"   target {t['labels']['job']} {t['scrapeUrl']}: {t['health']}")
exprs = [t["expr"] for p in json.load(open(dashboard))["panels"] for t in p.get("targets", [])]
names = sorted({m for e in exprs for m in re.findall(r"pagedkv:[A-Za-z0-9_:]+", e)})
missing = []
for name in names:
    result = query(name)
    print(f"   {name:48s} {len(result):3d} series  {result[0]['value'][1] if result else '-'}")
    if not result:
        missing.append(name)
if missing:
    sys.exit(f"   not in Prometheus: {missing}")
print(f"   all {len(names)} metrics the dashboard queries are in Prometheus")
EOF
took "prometheus check"

# ---- 5. the worker dies -------------------------------------------------------------------------
phase "kill -9 the worker's process (a crash, not \`docker kill\`, so the restart policy applies)"
worker=$("${COMPOSE[@]}" ps -q worker)
control=$("${COMPOSE[@]}" ps -q control-plane)
kill -9 "$(docker inspect -f '{{.State.Pid}}' "$worker")"
state() { docker inspect -f '{{.State.Status}} restarts={{.RestartCount}}' "$1" 2>/dev/null || echo gone; }
recovered="" i=0 deadline=$((SECONDS + ${RECOVERY_SECONDS:-120}))
while [ $SECONDS -lt $deadline ]; do
    sleep 3; i=$((i + 1))
    say "   /health $(health); worker $(state "$worker"); control-plane $(state "$control")"
    # once a worker runs again, try the golden: the stack has recovered when it is served
    if [ "$(docker inspect -f '{{.State.Running}}' "$worker")" = true ] && [ $((i % 3)) = 1 ]; then
        if golden; then recovered=yes; break; fi
    fi
done
took "after the kill"
say "   control-plane log, last lines:"
"${COMPOSE[@]}" logs --no-color --tail 8 control-plane 2>&1 | cut -c1-300 | sed 's/^/     /'
if [ -n "$recovered" ]; then
    say "RECOVERED: the worker container was restarted by its restart policy and the golden is served again"
else
    say "NOT RECOVERED within ${RECOVERY_SECONDS:-120} s: the golden is not served after the worker's restart (see the log above)"
    phase "restart the control plane by hand"
    "${COMPOSE[@]}" restart control-plane 2>&1 | sed 's/^/   /'
    for _ in $(seq 120); do [ "$(health)" = 200 ] && break; sleep 1; done
    say "   /health $(health); worker $(state "$worker"); control-plane $(state "$control")"
    if golden; then say "RECOVERED after a control-plane restart"; else say "NOT RECOVERED after a control-plane restart"; fi
    took "control-plane restart"
fi
say "checks passed: images built, no CUDA in pagedkv:cpu, golden served from containers, Prometheus scrapes every dashboard metric"
