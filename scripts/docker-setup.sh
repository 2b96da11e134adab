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
        say "no image registry reachable: making debian:bookworm-slim with debootstrap (about 30 s)"
        rootfs=$state/rootfs-bookworm
        as_root rm -rf "$rootfs"
        as_root debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$state/debootstrap.log" 2>&1 \
            || fail "debootstrap failed; see $state/debootstrap.log."
        as_root tar -C "$rootfs" -c . | docker import - debian:bookworm-slim >/dev/null \
            || fail "docker import of $rootfs failed."
        as_root rm -rf "$rootfs"
    fi
fi
say "base image debian:bookworm-slim $(docker image inspect --format '{{.Id}}' debian:bookworm-slim | cut -c8-19)"
