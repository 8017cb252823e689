#!/usr/bin/env bash
# Makes (once) a Debian trixie root holding Mesa 26.1's lavapipe, whose Vulkan driver has
# cooperative matrices (VK_KHR_cooperative_matrix: CubeCL's `cmma`), so that the tensor-core
# engine of the flash kernels runs on a CPU. Debian 12's lavapipe (the host's) has none.
#
#   scripts/lavapipe-trixie.sh            build the root if missing, then print its folder
#   scripts/lavapipe-trixie.sh --runner   also write ROOT/ulysses-run: a command that runs a host-built
#                                         binary through trixie's loader and lavapipe
#
# The root lives outside the checkout (${ULYSSES_TRIXIE_ROOT:-/var/tmp/ulysses-trixie},
# about 1 GB). Needs root, debootstrap and the Debian archive (the package registry).
# ../shared/DESIGN.md, "Tensor cores on the CPU", has the facts behind each step.
set -euo pipefail
root="${ULYSSES_TRIXIE_ROOT:-/var/tmp/ulysses-trixie}"
lvp="$root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so"

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"

if [ ! -e "$root/.complete" ]; then
    command -v debootstrap >/dev/null || {
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq debootstrap >/dev/null
    }
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    mirror="${mirror:-http://deb.debian.org/debian}"
    echo "lavapipe-trixie: debootstrap trixie into $root from $mirror" >&2
    $sudo rm -rf "$root"
    $sudo debootstrap --variant=minbase trixie "$root" "$mirror" >/dev/null
    echo "deb $mirror trixie-backports main" | $sudo tee "$root/etc/apt/sources.list.d/backports.list" >/dev/null
    $sudo chroot "$root" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo chroot "$root" apt-get install -y -qq -t trixie-backports \
        mesa-vulkan-drivers libvulkan1 >/dev/null
    $sudo chroot "$root" apt-get clean
    $sudo touch "$root/.complete"
fi
[ -e "$lvp" ] || { echo "lavapipe-trixie: $lvp is missing: remove $root and run again" >&2; exit 1; }

if [ "${1:-}" = "--runner" ]; then
    # An ICD of our own: the driver by absolute path, outside the root's /usr/share.
    $sudo tee "$root/lvp_icd.json" >/dev/null <<EOF
{ "file_format_version": "1.0.1", "ICD": { "library_path": "$lvp", "api_version": "1.4.0" } }
EOF
    # The host's loader cannot load trixie's libraries (GLIBC_PRIVATE symbols): trixie's own
    # loader runs the host-built binary with trixie's libraries first.
    $sudo tee "$root/ulysses-run" >/dev/null <<EOF
#!/bin/sh
export VK_ICD_FILENAMES="$root/lvp_icd.json"
exec "$root/lib64/ld-linux-x86-64.so.2" --library-path "$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu" "\$@"
EOF
    $sudo chmod +x "$root/ulysses-run"
fi
echo "$root"
