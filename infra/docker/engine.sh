#!/usr/bin/env bash
# The Docker engine that env servers in containers need (env.runtime=docker, or auto): installs it from the
# distribution's own packages (Debian/Ubuntu: docker.io) where there is none, starts the daemon where none is
# running, and says plainly why not when it cannot (not root, no cgroups, no package manager). A running engine is
# left alone, so it is safe to run again.
#   sudo infra/docker/engine.sh          # install if missing, start if not running
#   infra/docker/engine.sh --check       # exit 0 if an engine answers, else say why (exit 1); changes nothing
#   sudo infra/docker/engine.sh --stop   # stop the daemon this script started (not one started otherwise)
# Without systemd as PID 1 (containers, microVMs) the daemon runs detached with its log in $DOCKERD_LOG.
set -euo pipefail
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/scalinginter-dockerd.log}"
PIDFILE="${DOCKERD_PIDFILE:-/run/scalinginter-dockerd.pid}"
say() { echo "engine.sh: $*"; }
fail() { echo "engine.sh: $*" >&2; exit "${2:-1}"; }

engine_answers() { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }
describe() {
  docker info --format 'Docker engine {{.ServerVersion}} answers (storage {{.Driver}}, cgroup v{{.CgroupVersion}}, {{.NCPU}} CPUs)' 2>/dev/null \
    || echo "a Docker engine answers"
}
cgroups_present() {  # v2: a unified hierarchy with controllers; v1: a memory controller hierarchy
  [ -f /sys/fs/cgroup/cgroup.controllers ] || [ -d /sys/fs/cgroup/memory ] || grep -q '^cgroup' /proc/mounts
}

case "${1:-}" in
  --check)
    if engine_answers; then say "$(describe)"; exit 0; fi
    if ! command -v docker >/dev/null 2>&1; then fail "no docker CLI and no engine here: sudo infra/docker/engine.sh"; fi
    if [ -S /var/run/docker.sock ] && [ ! -w /var/run/docker.sock ]; then
      fail "a daemon socket exists but this user cannot use it: add the user to the docker group (or use sudo)"
    fi
    fail "no Docker engine answers: sudo infra/docker/engine.sh starts one" ;;
  --stop)
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      kill "$(cat "$PIDFILE")"; rm -f "$PIDFILE"; say "stopped the daemon started by this script"
    else
      say "no daemon started by this script is running"
    fi
    exit 0 ;;
  -h|--help) sed -n 2,9p "$0"; exit 0 ;;
  "") ;;
  *) fail "unknown argument $1 (use --check, --stop or nothing)" 2 ;;
esac

if engine_answers; then say "$(describe)"; exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  fail "no Docker engine answers, and installing or starting one needs root: run sudo infra/docker/engine.sh (or ask an administrator for a Docker engine and membership of the docker group). Until then env.runtime=auto runs env servers as processes." 3
fi
if ! cgroups_present; then
  fail "no cgroups are mounted under /sys/fs/cgroup, so a container engine cannot run (or limit) containers here: mount them (Debian: apt-get install cgroupfs-mount) or use a host that has them. env.runtime=process works without." 4
fi
if ! command -v dockerd >/dev/null 2>&1; then
  command -v apt-get >/dev/null 2>&1 \
    || fail "no dockerd and no apt-get: install the Docker engine with this system's package manager, then run this again" 5
  say "installing the Docker engine from the distribution's packages (docker.io)"
  t0=$(date +%s)
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io >/dev/null \
    || fail "apt-get install docker.io failed (see above)" 5
  say "installed in $(( $(date +%s) - t0 )) s"
fi
if [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ] && command -v systemctl >/dev/null 2>&1; then
  say "starting docker.service (systemd)"
  systemctl start docker || fail "systemctl start docker failed: journalctl -u docker says why"
else
  say "starting dockerd (no systemd here); log: $DOCKERD_LOG"
  # a new session: the daemon outlives this shell and a Ctrl-C in it
  setsid nohup dockerd >>"$DOCKERD_LOG" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
fi
for _ in $(seq 1 60); do
  if engine_answers; then say "$(describe)"; exit 0; fi
  if [ -f "$PIDFILE" ] && ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then break; fi
  sleep 0.5
done
tail -n 15 "$DOCKERD_LOG" >&2 2>/dev/null || true
fail "the daemon did not answer within 30 s (its log is above: a kernel without overlay or iptables support is the usual cause)" 6
