"""Defaults of the network role (see README.md)."""

# --- nftables (Linux) ---------------------------------------------------------------------------
# The one table meshdeploy owns. Nothing else in the ruleset is read, flushed or changed.
network_nft_family = "inet"
network_nft_table = "meshdeploy"
network_nft_chain = "input"
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
