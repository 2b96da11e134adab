#!/usr/bin/env bash
# Makes a machine ready to build and run our images, or says exactly what is missing:
#   1. the docker CLI and engine (Debian's docker.io where apt-get can install it; the daemon started with
#      overlay2, no bridge and no iptables: containers then use --network host);
#   2. the base image debian:bookworm-slim: pulled where a registry is reachable, otherwise made locally from
#      Debian's packages (debootstrap --variant=minbase bookworm) under the same public name, so the Dockerfiles
#      build the same here and anywhere.
# Repeatable: a second run finds everything in place.
set -euo pipefail
state=${SWIFTKV_DOCKER_STATE:-/tmp/swiftkv-docker}
mkdir -p "$state"
say() { echo "docker-setup: $*"; }
fail() { echo "docker-setup: $*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }
# The Debian mirror debootstrap fetches from: $DEBIAN_MIRROR, else the one this machine's apt uses for its main
# archive (a proxy or local mirror where the machine has one), else deb.debian.org.
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    local found="" etc=${APT_ETC:-/etc/apt}  # where apt keeps its sources (a test points it elsewhere)
    # deb822 .sources files: the URIs of a stanza whose Types has deb, skipping the security archive
    for f in "$etc"/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        found=$(awk 'BEGIN { RS = ""; FS = "\n" }
            /(^|\n)Types:[^\n]*deb([ \t\n]|$)/ { for (i = 1; i <= NF; i++) if ($i ~ /^URIs:/) {
                split($i, u, /[ \t]+/); if (u[2] !~ /security/) { print u[2]; exit } } }' "$f")
        [ -n "$found" ] && break
    done
    # one-line sources.list entries: "deb [options] URI suite components"
    if [ -z "$found" ] && [ -f "$etc/sources.list" ]; then
        found=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { if ($i !~ /security/) {
                print $i; exit } ; break } }' "$etc/sources.list")
    fi
    echo "${found:-http://deb.debian.org/debian}"
}
apt_install() {
    command -v apt-get >/dev/null || fail "$1 is missing and apt-get is not available: install $1."
    say "installing $* (Debian packages)"
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null \
        || fail "could not install $* with apt-get (run as root or with sudo)."
}

if ! command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; then
    apt_install docker.io
fi
command -v docker >/dev/null || fail "the docker CLI is missing (Debian: apt-get install docker.io)."

if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || fail "no Docker engine answers and dockerd is not installed."
    # a daemon killed with an earlier session leaves containerd's pid file and sockets behind; a new dockerd then
    # waits for that containerd until it times out ("timeout waiting for containerd to start")
    if ! pgrep -x dockerd >/dev/null && ! pgrep -x containerd >/dev/null; then
        as_root rm -f /var/run/docker/containerd/containerd.pid /var/run/docker/containerd/containerd*.sock* \
            /var/run/docker.pid
    fi
    say "starting dockerd (log: $state/dockerd.log)"
    as_root sh -c "nohup dockerd --storage-driver=overlay2 --iptables=false --bridge=none >'$state/dockerd.log' 2>&1 &" \
        || fail "cannot start dockerd (needs root)."
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || fail "dockerd did not come up; see $state/dockerd.log."
fi
say "engine $(docker version --format '{{.Server.Version}}') ($(docker info --format '{{.Driver}}'))"

if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
    if timeout 60 docker pull -q debian:bookworm-slim >/dev/null 2>&1; then
        say "pulled debian:bookworm-slim"
    else
        command -v debootstrap >/dev/null || apt_install debootstrap
        mirror=$(debian_mirror)
        say "no image registry reachable: making debian:bookworm-slim with debootstrap from $mirror (about 30 s)"
        rootfs=$state/rootfs-bookworm
        as_root rm -rf "$rootfs"
        as_root debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$state/debootstrap.log" 2>&1 \
            || fail "debootstrap failed; see $state/debootstrap.log."
        as_root tar -C "$rootfs" -c . | docker import - debian:bookworm-slim >/dev/null \
            || fail "docker import of $rootfs failed."
        as_root rm -rf "$rootfs"
    fi
fi
say "base image debian:bookworm-slim $(docker image inspect --format '{{.Id}}' debian:bookworm-slim | cut -c8-19)"
