#!/bin/sh
# Build a Debian 12 (bookworm) libvirt box for the Vagrant lab from the Debian mirrors, and add it
# to Vagrant under $MESHDEPLOY_BOX (the name the Vagrantfile reads). No Vagrant Cloud needed.
#
#   scripts/vagrant-box.sh [OUTPUT.box]      # as root; default /var/tmp/meshdeploy-bookworm64.box
#
# The box has what meshdeploy relies on in the public debian/bookworm64 box: the `vagrant` user
# with Vagrant's insecure public key (copied from the installed Vagrant, never typed in), sudo
# without a password, python3, openssh-server, ifupdown + DHCP on eth0 (Vagrant's Debian guest
# plugin writes the private network into /etc/network/interfaces). It boots with extlinux from
# a real MBR disk, so it needs neither KVM nor direct kernel boot.
#
# Inputs (environment): MESHDEPLOY_BOX (box name, default meshdeploy/bookworm64),
# MESHDEPLOY_BOX_MIRROR (Debian mirror, default http://deb.debian.org/debian),
# MESHDEPLOY_BOX_DISK (virtual disk size, default 20G), MESHDEPLOY_BOX_ADD=0 (build only).
set -eu

BOX_NAME=${MESHDEPLOY_BOX:-meshdeploy/bookworm64}
MIRROR=${MESHDEPLOY_BOX_MIRROR:-http://deb.debian.org/debian}
DISK_SIZE=${MESHDEPLOY_BOX_DISK:-20G}
OUTPUT=${1:-/var/tmp/meshdeploy-bookworm64.box}
PACKAGES=systemd,systemd-sysv,udev,dbus,kmod,linux-image-amd64,initramfs-tools,openssh-server,\
python3,sudo,ifupdown,isc-dhcp-client,iproute2,netbase,ca-certificates,less
# 1 MiB before the root partition, as fdisk leaves it: room for the MBR and alignment.
PART_OFFSET=1048576

die() { echo "vagrant-box: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (debootstrap, loop devices, mount)"
for tool in debootstrap qemu-img sfdisk losetup mkfs.ext4 extlinux vagrant; do
    command -v "$tool" >/dev/null || die "$tool is missing: apt-get install debootstrap qemu-utils \
fdisk mount e2fsprogs extlinux syslinux-common vagrant"
done
MBR_BIN=/usr/lib/syslinux/mbr/mbr.bin
[ -r "$MBR_BIN" ] || die "$MBR_BIN is missing: apt-get install syslinux-common"
# Vagrant's own copy of its public insecure key (the Debian package ships it with the gem).
VAGRANT_PUB=$(find /usr/share/rubygems-integration /usr/lib/ruby /opt/vagrant -path '*vagrant*/keys/vagrant.pub' \
    2>/dev/null | head -n 1)
[ -n "$VAGRANT_PUB" ] || die "Vagrant's keys/vagrant.pub not found: apt-get install vagrant"

WORK=$(mktemp -d /var/tmp/md-vagrant-box.XXXXXX)
ROOT="$WORK/root"
LOOP=""
cleanup() {
    for fs in dev/pts dev proc sys; do
        mountpoint -q "$ROOT/$fs" 2>/dev/null && umount "$ROOT/$fs"
    done
    mountpoint -q "$ROOT" 2>/dev/null && umount "$ROOT"
    [ -n "$LOOP" ] && losetup -d "$LOOP"
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

echo "vagrant-box: partitioning a $DISK_SIZE disk"
truncate -s "$DISK_SIZE" "$WORK/disk.raw"
echo "start=$((PART_OFFSET / 512)), type=83, bootable" | sfdisk -q --label dos "$WORK/disk.raw"
# A loop device over the partition alone: partition nodes (loopNp1) need udev, absent here.
LOOP=$(losetup --find --show --offset "$PART_OFFSET" "$WORK/disk.raw")
# extlinux 6.04 cannot read ext4's 64bit layout.
mkfs.ext4 -q -O ^64bit -L root "$LOOP"
UUID=$(blkid -s UUID -o value "$LOOP")
mkdir "$ROOT"
mount "$LOOP" "$ROOT"

echo "vagrant-box: debootstrap bookworm from $MIRROR"
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOT" "$MIRROR" \
    >"$WORK/debootstrap.log" 2>&1 || { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
echo "vagrant-box: debootstrap took $(( $(date +%s) - start )) s"

KERNEL=$(cd "$ROOT/boot" && ls vmlinuz-* | sort -V | tail -n 1)
INITRD=initrd.img-${KERNEL#vmlinuz-}
[ -f "$ROOT/boot/$INITRD" ] || die "no $INITRD in the root (initramfs-tools did not run)"

cat >"$ROOT/etc/fstab" <<EOF
UUID=$UUID / ext4 errors=remount-ro 0 1
EOF
# eth0 is Vagrant's management network (DHCP); Vagrant appends the private network (eth1).
cat >"$ROOT/etc/network/interfaces" <<'EOF'
source /etc/network/interfaces.d/*

auto lo
iface lo inet loopback

allow-hotplug eth0
iface eth0 inet dhcp
EOF
echo vagrant >"$ROOT/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tvagrant\n' >"$ROOT/etc/hosts"
cat >"$ROOT/etc/apt/sources.list" <<EOF
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF

chroot "$ROOT" useradd --create-home --shell /bin/bash vagrant
install -d -m 700 -o 1000 -g 1000 "$ROOT/home/vagrant/.ssh"
install -m 600 -o 1000 -g 1000 "$VAGRANT_PUB" "$ROOT/home/vagrant/.ssh/authorized_keys"
[ "$(chroot "$ROOT" id -u vagrant)" = 1000 ] || die "the vagrant user is not uid 1000"
echo 'vagrant ALL=(ALL) NOPASSWD:ALL' >"$ROOT/etc/sudoers.d/vagrant"
chmod 440 "$ROOT/etc/sudoers.d/vagrant"

# Each VM makes its own host keys and machine-id on first boot.
rm -f "$ROOT"/etc/ssh/ssh_host_*
cat >"$ROOT/etc/systemd/system/ssh-hostkeys.service" <<'EOF'
[Unit]
Description=Generate missing SSH host keys
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
EOF
chroot "$ROOT" systemctl enable ssh-hostkeys.service ssh.service >/dev/null 2>&1
: >"$ROOT/etc/machine-id"
rm -f "$ROOT/var/lib/dbus/machine-id"
chroot "$ROOT" apt-get clean

echo "vagrant-box: extlinux, kernel $KERNEL"
mkdir -p "$ROOT/boot/extlinux"
cat >"$ROOT/boot/extlinux/extlinux.conf" <<EOF
DEFAULT debian
TIMEOUT 1
LABEL debian
  LINUX /boot/$KERNEL
  INITRD /boot/$INITRD
  APPEND root=UUID=$UUID ro net.ifnames=0 biosdevname=0 console=tty0 console=ttyS0,115200n8
EOF
extlinux --install "$ROOT/boot/extlinux" >/dev/null
umount "$ROOT"
losetup -d "$LOOP"
LOOP=""
dd if="$MBR_BIN" of="$WORK/disk.raw" bs=440 count=1 conv=notrunc status=none

echo "vagrant-box: packaging $OUTPUT"
mkdir "$WORK/box"
qemu-img convert -f raw -O qcow2 "$WORK/disk.raw" "$WORK/box/box.img"
rm "$WORK/disk.raw"
GIB=$(qemu-img info --output=json "$WORK/box/box.img" | python3 -c \
    'import json, sys; print(-(-json.load(sys.stdin)["virtual-size"] // 2**30))')
printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %s}\n' "$GIB" >"$WORK/box/metadata.json"
cat >"$WORK/box/Vagrantfile" <<'EOF'
Vagrant.configure("2") do |config|
  config.vm.provider :libvirt do |lv|
    lv.disk_bus = "virtio"
  end
end
EOF
tar -C "$WORK/box" -cf "$OUTPUT" metadata.json Vagrantfile box.img
echo "vagrant-box: $OUTPUT ($(du -h "$OUTPUT" | cut -f1))"

if [ "${MESHDEPLOY_BOX_ADD:-1}" != 0 ]; then
    vagrant box add --force --name "$BOX_NAME" "$OUTPUT"
fi
