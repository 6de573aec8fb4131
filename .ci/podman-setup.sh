#!/usr/bin/env bash
# Root setup so rootful podman works on a fresh Debian bookworm machine of this kind
# (a container host with hybrid cgroup v1, no systemd, a fixed RLIMIT_NOFILE ceiling).
# Idempotent: packages are installed only when missing, config files are rewritten
# with the same content, nothing else is touched.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "podman-setup: run as root" >&2
    exit 1
fi

# runc, not crun: crun 1.8 fails here with "cgroups in hybrid mode not supported" and
# cannot raise RLIMIT_NOFILE. debootstrap builds the base image; bubblewrap is the bwrap sandbox.
pkgs=(podman runc conmon netavark slirp4netns uidmap bubblewrap debootstrap tar ca-certificates iptables procps)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "podman-setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Without systemd as PID 1 neither the systemd cgroup manager nor journald events work.
if [ -d /run/systemd/system ]; then
    cgroup_manager=systemd
    events_logger=journald
else
    cgroup_manager=cgroupfs
    events_logger=file
fi

mkdir -p /etc/containers/containers.conf.d
conf=/etc/containers/containers.conf.d/50-tmax.conf
tmp=$(mktemp)
cat >"$tmp" <<CONF
# Written by tmax .ci/podman-setup.sh; safe to rewrite.
[containers]
# The host's hard RLIMIT_NOFILE is 20000, and the OCI runtime may not raise the
# inherited soft limit past it, so every container gets explicit limits under it.
default_ulimits = ["nofile=1024:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "${cgroup_manager}"
events_logger = "${events_logger}"
CONF
if ! cmp -s "$tmp" "$conf" 2>/dev/null; then
    install -m 0644 "$tmp" "$conf"
    echo "podman-setup: wrote $conf"
fi
rm -f "$tmp"

# No Docker Hub here: images are built locally (localhost/...). Keep short names
# from silently resolving to a registry that is unreachable.
reg=/etc/containers/registries.conf.d/50-tmax.conf
tmp=$(mktemp)
cat >"$tmp" <<CONF
# Written by tmax .ci/podman-setup.sh.
short-name-mode = "permissive"
CONF
if ! cmp -s "$tmp" "$reg" 2>/dev/null; then
    install -m 0644 "$tmp" "$reg"
    echo "podman-setup: wrote $reg"
fi
rm -f "$tmp"

# overlay needs kernel support; inside some container hosts only vfs works.
if [ ! -f /etc/containers/storage.conf ]; then
    if ! podman info --format '{{.Store.GraphDriverName}}' >/dev/null 2>&1; then
        printf '[storage]\ndriver = "vfs"\nrunroot = "/run/containers/storage"\ngraphroot = "/var/lib/containers/storage"\n' \
            >/etc/containers/storage.conf
        echo "podman-setup: overlay unusable, wrote vfs storage.conf"
    fi
fi

# Rootless and netavark setups want /dev/net/tun; some hosts ship without it.
if [ ! -e /dev/net/tun ]; then
    mkdir -p /dev/net && mknod /dev/net/tun c 10 200 && chmod 0666 /dev/net/tun || true
fi

# Smoke test: a throw-away container from an empty rootfs would need an image, so
# check the runtime wiring instead.
podman info --format 'podman-setup: ok (runtime {{.Host.OCIRuntime.Name}}, cgroups {{.Host.CgroupManager}}, events {{.Host.EventLogger}}, storage {{.Store.GraphDriverName}})'
