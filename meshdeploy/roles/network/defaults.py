"""Defaults of the network role (see README.md)."""

# --- nftables (Linux) ---------------------------------------------------------------------------
# The one table meshdeploy owns. Nothing else in the ruleset is read, flushed or changed.
network_nft_family = "inet"
network_nft_table = "meshdeploy"
network_nft_chain = "input"
# The chain that keeps a root host's loopback rpc-server ports (network.transport: ssh) from its
# local users: it drops a connection whose socket belongs to any uid but root, the login user
# (sshd's forwards run as it) and, where a llama-server of the host dials its own rpc-server,
# systemd's DynamicUser= range (that llama-server's uid is picked from it at every start).
network_nft_output_chain = "output"
network_dynamic_uids = (61184, 65519)
# Where the rendered table lives on the host, and the unit that loads it again at boot (a
# ruleset is gone after a reboot; the rpc-servers come back enabled).
network_nft_file = "/etc/meshdeploy/network/meshdeploy.nft"
network_nft_unit = "meshdeploy-nftables"
network_unit_dir = "/etc/systemd/system"

# --- pf (macOS) ---------------------------------------------------------------------------------
# The main ruleset (/etc/pf.conf) must reference the anchor for its rules to be evaluated.
network_pf_anchor = "meshdeploy"
network_pf_file = "/etc/pf.anchors/meshdeploy"

# --- both -----------------------------------------------------------------------------------------
# What "loopback" is called in an allow-list: anything that arrives on the loopback interface,
# which on Linux and macOS includes what a host sends to its own addresses.
network_loopback = "lo"
network_loopback_ifaces = {"nft": "lo", "pf": "lo0"}

# --- WireGuard (network.transport: wireguard) ---------------------------------------------------
# The rendered wg-quick file holds no private key: its PostUp loads the key from a root-only
# file that apply generates on the host (`wg genkey`), so the key never leaves it.
network_wg_conf_dir = "/etc/wireguard"
network_wg_key_dir = "/etc/meshdeploy/wireguard"
# Packages that bring `wg`/`wg-quick`, and the userspace implementation for kernels without the
# module (wg-quick starts wireguard-go when `ip link add type wireguard` fails).
network_wg_packages = ("wireguard-tools",)
network_wg_userspace_packages = ("wireguard-go",)
# The first release of a distribution (os-release ID: major VERSION_ID) whose packages have
# wireguard-go: Debian 11 has none (checked on its mirror), so a bullseye host whose kernel lacks
# the module cannot join the tunnel, and apt-get would fail half way through an apply.
network_wg_userspace_since = {"debian": 12}
# macOS (rendered and golden-tested only): Homebrew's wireguard-tools + wireguard-go, started at
# boot by a LaunchDaemon.
network_wg_brew_prefix = "/opt/homebrew"
network_wg_launchd_label = "org.meshdeploy.wireguard"
network_wg_launchd_dir = "/Library/LaunchDaemons"
