#!/usr/bin/env bash
# The deployment, run for real on one machine: build the CPU image, bring up host A's and host B's compose
# projects (both hosts on loopback, host networking), and check what an operator would. One command, as root on
# Debian/Ubuntu (it installs docker.io, docker-compose, debootstrap and prometheus when missing and starts dockerd
# when none runs):
#
#   sudo bash docker/smoke.sh              # from the repository root; ~10-20 minutes on 2 cores
#
# Not part of CI (it needs root and a docker daemon). It prints a table of checks; it exits non-zero if one fails.
# Environment: KEEP=1 leaves the stacks running at the end; PYTHON (the host's python with the project
# installed: pip install -e '.[test]'); TORCH_INDEX (an extra pip index for the host's torch build).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/dflash-smoke}
ENV_FILE=docker/smoke.env
IMAGE=dflash-serve:cpu
BASE=dflash-base:bookworm
PROM_IMAGE=dflash-prometheus:local
mkdir -p "$WORK"
RESULTS="$WORK/results.tsv"
: > "$RESULTS"

say() { printf '\n== %s\n' "$*" >&2; }
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$RESULTS"; printf '   %-34s %-5s %s\n' "$1" "$2" "$3" >&2; }
now() { date +%s.%N; }
since() { "$PYTHON" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$1" "$(now)"; }
compose() {  # compose a|b [args]: one host's project, with the smoke's variables
  local host=$1; shift
  docker-compose --env-file "$ENV_FILE" -p "dflash-host-$host" -f "docker/compose.host-$host.yml" "$@"
}

# --- what the machine needs ---------------------------------------------------------------------------------
need=()
command -v dockerd > /dev/null || need+=(docker.io)
command -v docker-compose > /dev/null || need+=(docker-compose)
command -v debootstrap > /dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  [ "$(id -u)" = 0 ] || { echo "smoke.sh: run as root to install ${need[*]}" >&2; exit 2; }
  say "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" > "$WORK/apt.log"
fi
if ! docker info > /dev/null 2>&1; then
  say "starting dockerd (log: $WORK/dockerd.log)"
  (dockerd > "$WORK/dockerd.log" 2>&1 &)
  for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
  docker info > /dev/null 2>&1 || { echo "smoke.sh: dockerd did not start: see $WORK/dockerd.log" >&2; exit 2; }
fi
row "docker" ok "daemon $(docker version --format '{{.Server.Version}}'), $(docker-compose version --short)"

# --- images -------------------------------------------------------------------------------------------------
rootfs() {  # rootfs NAME PACKAGES: a Debian bookworm root imported as an image (no registry needed)
  local name=$1 packages=$2 dir="$WORK/rootfs-${1//[:\/]/-}"
  rm -rf "$dir"
  debootstrap --variant=minbase --include="$packages" bookworm "$dir" http://deb.debian.org/debian \
    > "$WORK/debootstrap-${1//[:\/]/-}.log" 2>&1
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | docker import "${@:3}" - "$name" > /dev/null
  rm -rf "$dir"
}
if ! docker image inspect "$BASE" > /dev/null 2>&1; then
  say "making $BASE with debootstrap"
  t0=$(now); rootfs "$BASE" python3,python3-venv,ca-certificates,passwd,g++; row "base image" ok "debootstrap $(since "$t0")"
fi
if ! docker image inspect "$PROM_IMAGE" > /dev/null 2>&1; then
  say "making $PROM_IMAGE (Debian's prometheus; the registry's prom/prometheus cannot be pulled here)"
  rootfs "$PROM_IMAGE" prometheus,wget,ca-certificates \
    --change 'ENTRYPOINT ["/usr/bin/prometheus"]' --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml"]'
fi

say "building $IMAGE (wheels on the host, then docker build; logs in $WORK)"
t0=$(now)
context="$WORK/context"
rm -rf "$context" && mkdir -p "$context/models" "$context/wheels"
image_python=$(docker run --rm "$BASE" python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
host_python=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[ "$image_python" = "$host_python" ] || { echo "smoke.sh: the image's Python is $image_python, the host's $host_python: the wheels would not fit (set PYTHON)" >&2; exit 2; }
torch_pin=$("$PYTHON" -c 'import torch; print(torch.__version__)')
# the host's own torch (a CPU build where it is one); TORCH_INDEX adds an index for it, e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu where pip's own indexes lack the +cpu builds
"$PYTHON" -m pip wheel -q -w "$context/wheels" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
  "torch==$torch_pin" "$ROOT" > "$WORK/wheels.log" 2>&1 || { tail -5 "$WORK/wheels.log" >&2; exit 1; }
cp -r pyproject.toml README.md shared cuda_ext gateway client verify_worker draft_worker training demo_build "$context/"
cp -r models/demo "$context/models/demo"
find "$context" -name __pycache__ -prune -exec rm -rf {} +
DOCKER_BUILDKIT=0 docker build -q -f docker/Dockerfile.cpu -t "$IMAGE" "$context" > "$WORK/build.log" 2>&1 \
  || { tail -20 "$WORK/build.log" >&2; exit 1; }
size=$(docker image inspect "$IMAGE" --format '{{.Size}}' | "$PYTHON" -c 'print(f"{int(input()) / 2**20:.0f} MiB")')
row "build $IMAGE" ok "$(since "$t0"), image $size, torch $torch_pin"

# --- up -----------------------------------------------------------------------------------------------------
teardown() { compose a down -v --remove-orphans > /dev/null 2>&1 || true; compose b --profile tp2 down -v --remove-orphans > /dev/null 2>&1 || true; }
teardown
trap '[ "${KEEP:-0}" = 1 ] || teardown' EXIT
GATEWAY=http://127.0.0.1:8000
# Host B's address as seen from host A's roles (host networking) and from the Prometheus container (a bridge
# network): the docker bridge's address on this machine serves both (loopback would be the container itself).
subnet=$(docker network inspect bridge --format '{{(index .IPAM.Config 0).Subnet}}')
DFLASH_HOST_B=$("$PYTHON" -c 'import ipaddress, sys; print(ipaddress.ip_network(sys.argv[1])[1])' "$subnet")
export DFLASH_HOST_B
up() {  # up WORLD_SIZE: host B (draft; rank 1 at TP 2), then host A's dflash services and Prometheus
  local world=$1 profile=()
  [ "$world" = 2 ] && profile=(--profile tp2)
  DFLASH_TP_WORLD_SIZE=$world compose b "${profile[@]}" up -d --no-build > "$WORK/up-b.log" 2>&1
  DFLASH_TP_WORLD_SIZE=$world compose a up -d --no-build verify gateway prometheus > "$WORK/up-a.log" 2>&1
  "$PYTHON" docker/smoke_checks.py ready "$GATEWAY" --timeout 600
}
say "up: host B (draft worker), host A (verify, gateway, Prometheus)"
t0=$(now)
if up 1 > "$WORK/ready.log" 2>&1; then row "ready (TP 1)" ok "$(since "$t0") from up to /ready 200"
else row "ready (TP 1)" FAIL "$(tail -1 "$WORK/ready.log")"; exit 1; fi

check() {  # check NAME CMD...: one row from a smoke_checks.py command's last line
  local name=$1; shift
  if out=$("$@" 2> "$WORK/$name.log"); then row "$name" ok "$out"; else row "$name" FAIL "$(tail -1 "$WORK/$name.log")"; fi
}
check "openai client" "$PYTHON" docker/smoke_checks.py openai "$GATEWAY"
check "reference (alone)" "$PYTHON" docker/smoke_checks.py reference "$GATEWAY" "$WORK/reference.json"
check "prometheus targets" "$PYTHON" docker/smoke_checks.py targets http://127.0.0.1:9090
check "dashboard queries" "$PYTHON" docker/smoke_checks.py dashboard "$GATEWAY" http://127.0.0.1:9090
draft=$(compose b ps -q draft)
check "draft killed mid-stream" "$PYTHON" docker/smoke_checks.py during "$GATEWAY" "$WORK/reference.json" \
  "kill -9 $(docker inspect --format '{{.State.Pid}}' "$draft")"
check "draft restarted, drafts" "$PYTHON" docker/smoke_checks.py drafts-again "$GATEWAY" "$draft"
check "docker kill of the draft" "$PYTHON" docker/smoke_checks.py docker-kill "$draft"
compose b up -d --no-build draft > /dev/null 2>&1
"$PYTHON" docker/smoke_checks.py ready "$GATEWAY" --timeout 120 > /dev/null 2>&1 || true
check "stop host A drains" "$PYTHON" docker/smoke_checks.py drain "$GATEWAY" \
  "docker-compose --env-file $ENV_FILE -p dflash-host-a -f docker/compose.host-a.yml stop gateway verify"

say "TP 2: verify rank 1 in host B's project joins rank 0 (gloo on CPU)"
teardown
t0=$(now)
if up 2 > "$WORK/ready-tp2.log" 2>&1; then
  row "ready (TP 2)" ok "$(since "$t0")"
  check "TP 2 == TP 1 (greedy)" "$PYTHON" docker/smoke_checks.py compare "$GATEWAY" "$WORK/reference.json"
else
  row "ready (TP 2)" FAIL "$(tail -1 "$WORK/ready-tp2.log")"
fi

printf '\n| check | result | figures |\n| --- | --- | --- |\n'
awk -F'\t' '{printf "| %s | %s | %s |\n", $1, $2, $3}' "$RESULTS"
! grep -q "	FAIL	" "$RESULTS"
