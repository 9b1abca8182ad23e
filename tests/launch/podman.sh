#!/usr/bin/env bash
# Starts or stops podman's Docker-compatible API service for the docker
# launch tests (../shared/docs/ENGINES.md has how it was worked out).
#
#   tests/launch/podman.sh start DIR   # DIR/env then holds
#                                      #   DEEPNEX_TEST_DOCKER_SOCKET=DIR/podman.sock
#                                      #   DEEPNEX_TEST_DOCKER_IMAGE=localhost/busybox:latest
#   tests/launch/podman.sh stop DIR
#
# Everything lives in the scratch directory DIR: vfs image storage, run
# state, a containers.conf that asks only for what this sandbox grants
# (ulimits within its hard limits, cgroupfs, runc, file events), and one
# image, localhost/busybox:latest: busybox-static with a link per applet.
# `start` first stops what an earlier run in DIR left, so it can be run
# twice. Where podman or busybox-static is missing, or the service does not
# come up, `start` says so and exits 0 without writing DIR/env: the tests
# then skip with that reason.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action=$1
dir=$2
[[ $dir == /* ]] || { echo "podman.sh: DIR must be absolute, got $dir" >&2; exit 2; }
dir=${dir%/}
podman=${PODMAN:-podman}
busybox=${BUSYBOX:-/bin/busybox}
PYTHON=${PYTHON:-/usr/bin/python3}
image=localhost/busybox:latest

podman_in_dir() {
  CONTAINERS_CONF=$dir/containers.conf "$podman" --root "$dir/root" --runroot "$dir/run" \
    --storage-driver=vfs --tmpdir "$dir/tmp" "$@"
}

stop() {
  if [[ -f $dir/service.pid ]]; then
    local pid
    pid=$(cat "$dir/service.pid")
    # Only if it still is our service (the PID may have been reused).
    if grep -qsF -- "$dir/podman.sock" "/proc/$pid/cmdline"; then
      if [[ -S $dir/podman.sock ]]; then
        # Containers the tests left: their conmon and runc state live in DIR.
        podman_in_dir rm --all --force --time 0 >/dev/null 2>&1 || true
      fi
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do
        [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) =~ ^[^Z]$ ]] || break
        sleep 0.1
      done
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  if [[ -d $dir ]]; then
    # vfs layers and the runroot can hold mounts: unmount before deleting.
    { grep -F " $dir/" /proc/mounts || true; } | awk '{print $2}' | sort -r | while read -r m; do
      umount -l "$m" 2>/dev/null || true
    done
    rm -rf "$dir"
  fi
}

# Whether GET /_ping on the socket answers OK.
ping_service() {
  "$PYTHON" - "$dir/podman.sock" <<'EOF' >/dev/null 2>&1
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(2)
s.connect(sys.argv[1])
s.sendall(b"GET /_ping HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
reply = b""
while chunk := s.recv(4096):
    reply += chunk
sys.exit(0 if reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"OK") else 1)
EOF
}

cannot() {
  echo "podman.sh: cannot start podman's Docker API service here: $1; the docker tests will skip"
  exit 0
}

start() {
  stop
  command -v "$podman" >/dev/null || cannot "podman is not installed (apt-get install podman)"
  [[ -x $busybox ]] || cannot "$busybox is missing (apt-get install busybox-static)"
  mkdir -p "$dir"/{root,run,tmp,rootfs/bin}
  cat >"$dir/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
EOF
  cp "$busybox" "$dir/rootfs/bin/busybox"
  # One process for the ~400 links: a fork each takes seconds on a busy machine.
  "$busybox" --list | "$PYTHON" -c '
import os, sys
for applet in sys.stdin.read().split():
    if applet != "busybox":
        os.symlink("busybox", os.path.join(sys.argv[1], applet))' "$dir/rootfs/bin"
  tar -C "$dir/rootfs" -cf "$dir/busybox.tar" .
  podman_in_dir import --quiet "$dir/busybox.tar" "$image" >"$dir/import.log" 2>&1 ||
    cannot "podman import failed: $(tail -1 "$dir/import.log")"
  rm -rf "$dir/rootfs" "$dir/busybox.tar"
  # A simple command, so that $! is podman's own PID.
  CONTAINERS_CONF=$dir/containers.conf "$podman" --root "$dir/root" --runroot "$dir/run" \
    --storage-driver=vfs --tmpdir "$dir/tmp" system service --time=0 "unix://$dir/podman.sock" \
    >"$dir/service.log" 2>&1 &
  echo $! >"$dir/service.pid"
  # A deadline, not a count of tries: on a busy machine each ping (a Python)
  # takes a while, and so does podman's start.
  local deadline=$((SECONDS + 60))
  while (( SECONDS < deadline )); do
    if [[ -S $dir/podman.sock ]] && ping_service; then
      {
        echo "DEEPNEX_TEST_DOCKER_SOCKET=$dir/podman.sock"
        echo "DEEPNEX_TEST_DOCKER_IMAGE=$image"
      } >"$dir/env"
      echo "podman.sh: Docker API at $dir/podman.sock"
      return
    fi
    sleep 0.1
  done
  kill -KILL "$(cat "$dir/service.pid")" 2>/dev/null || true
  cannot "the service did not answer /_ping within 60 s: $(tail -1 "$dir/service.log")"
}

case $action in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
