#!/usr/bin/env bash
# A private Docker engine for machines that have Debian's docker.io but no running daemon (this
# project's machines and CI). Everything it owns sits in its own places, so it clashes with no
# other engine on the machine:
#
#   MORI_DOCKERD_RUN   (default /tmp/mori-dockerd)            socket docker.sock, exec-root,
#                                                             pidfile, log dockerd.log
#   MORI_DOCKERD_DATA  (default ~/.cache/mori/docker/engine)  data-root: images, volumes and
#                                                             build cache, kept between runs
#
#   eval "$(scripts/local_dockerd.sh start)"   # prints: export DOCKER_HOST=unix://.../docker.sock
#   scripts/local_dockerd.sh status            # exit 0 when it answers
#   scripts/local_dockerd.sh stop              # stops it; the data-root stays (the cache)
#
# `start` is idempotent: when the engine already answers it only prints the export line, and its
# second line says so (`# already running`), so a caller knows whether it owns the engine.
# Needs root (dockerd does). Installs docker.io with apt-get when dockerd is missing. The storage
# driver is dockerd's own choice (overlay2 on an ext4 disk); MORI_DOCKERD_STORAGE_DRIVER=vfs
# forces the driver that works everywhere (every layer a full copy: keep images small).
set -euo pipefail

RUN_DIR="${MORI_DOCKERD_RUN:-/tmp/mori-dockerd}"
DATA_DIR="${MORI_DOCKERD_DATA:-$HOME/.cache/mori/docker/engine}"
SOCKET="$RUN_DIR/docker.sock"
PIDFILE="$RUN_DIR/dockerd.pid"
LOG="$RUN_DIR/dockerd.log"
export DOCKER_HOST="unix://$SOCKET"

answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

start() {
  if answers; then
    echo "export DOCKER_HOST=$DOCKER_HOST"
    echo "# already running"
    return
  fi
  [[ $EUID -eq 0 ]] || { echo "local_dockerd: dockerd needs root" >&2; exit 1; }
  if ! command -v dockerd >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq docker.io) >&2
  fi
  mkdir -p "$RUN_DIR" "$DATA_DIR"
  local driver=()
  [[ -n "${MORI_DOCKERD_STORAGE_DRIVER:-}" ]] && driver=(--storage-driver "$MORI_DOCKERD_STORAGE_DRIVER")
  # setsid: the engine outlives this script and the caller's process group; `stop` ends it.
  setsid dockerd --host "$DOCKER_HOST" --data-root "$DATA_DIR" --exec-root "$RUN_DIR/exec" \
    --pidfile "$PIDFILE" "${driver[@]}" >"$LOG" 2>&1 </dev/null &
  for _ in $(seq 120); do
    answers && { echo "export DOCKER_HOST=$DOCKER_HOST"; return; }
    kill -0 $! 2>/dev/null || break
    sleep 0.5
  done
  echo "local_dockerd: dockerd did not come up; last lines of $LOG:" >&2
  tail -n 20 "$LOG" >&2
  exit 1
}

stop() {
  [[ -f "$PIDFILE" ]] || { echo "local_dockerd: not running (no $PIDFILE)" >&2; return; }
  local pid
  pid="$(cat "$PIDFILE")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 60); do
    kill -0 "$pid" 2>/dev/null || { echo "local_dockerd: stopped" >&2; return; }
    sleep 0.5
  done
  echo "local_dockerd: dockerd $pid still running after 30 s" >&2
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) answers ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
