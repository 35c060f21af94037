"""Lab hosts of another architecture (lab/arches.py): their bases, and the binfmt_misc entry
that runs them, checked against a binfmt_misc folder of the test's own (the kernel's is the
machine's; docs/lab.md's arm64 run uses that one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshdeploy.lab import arches, base
from meshdeploy.lab.cli import main
from meshdeploy.lab.errors import LabError

DEBIAN_CONF = (r":qemu-aarch64:M::\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00"
               r"\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff"
               r"\xff\xff\xfe\xff\xff\xff:/usr/libexec/qemu-binfmt/aarch64-binfmt-P:OPF")


def test_an_arm64_base_is_a_recipe_of_its_own_and_the_amd64_ones_keep_theirs():
    plain, arm = base.recipe(), base.recipe(arch="arm64")
    assert base.recipe(arch="amd64") == plain and "arch" not in plain
    assert arm["arch"] == "arm64" and base.recipe_hash(arm) != base.recipe_hash(plain)
    # Its systemd cannot set up credentials under qemu: the units that load some get none.
    assert plain["setup"] + base.EMULATED_SETUP == arm["setup"]
    assert "LoadCredential=" in base.EMULATED_SETUP


def test_unknown_architectures_and_hosts_are_refused_naming_them():
    assert arches.resolve({"node2": "arm64"}, ["node1", "node2"]) == {
        "node1": "amd64", "node2": "arm64"}
    with pytest.raises(LabError, match="node2: unknown architecture 'riscv64'"):
        arches.resolve({"node2": "riscv64"}, ["node1", "node2"])
    with pytest.raises(LabError, match="node4, not a host of this lab"):
        arches.resolve({"node4": "arm64"}, ["node1", "node2"])
    assert main(["up", "--name", "mdax", "--arch", "node2"]) == 1


def test_a_running_host_asked_for_another_architecture_is_named_with_both():
    from meshdeploy.lab.core import _differs

    assert _differs("node2", ("root", "bookworm", "arm64"), ("root", "bookworm", "amd64")) == \
        "node2 is arm64, not amd64"


def fake_binfmt(tmp_path: Path, entry: str | None) -> tuple[Path, Path]:
    root, conf = tmp_path / "binfmt_misc", tmp_path / "binfmt.d"
    root.mkdir()
    conf.mkdir()
    (root / "register").write_text("")
    (conf / "qemu-aarch64.conf").write_text(DEBIAN_CONF + "\n")
    if entry is not None:
        (root / "qemu-aarch64").write_text(entry)
    return root, conf


def test_an_entry_with_the_flags_a_lab_host_needs_is_left_alone(tmp_path):
    root, conf = fake_binfmt(tmp_path, "enabled\ninterpreter /x\nflags: POCF\noffset 0\n")
    arches.ensure("arm64", root, conf)
    assert (root / "register").read_text() == ""
    assert arches.flags("arm64", root) == "POCF"
    arches.ensure("amd64", tmp_path / "nowhere")  # the machine's own: nothing to do


def test_debians_entry_without_c_is_registered_again_with_it(tmp_path):
    """Debian's POF runs a setuid binary as its caller (sudo in an arm64 host: "effective uid is
    not 0"); the entry is removed and registered again from Debian's line with C and F."""
    root, conf = fake_binfmt(tmp_path, "enabled\ninterpreter /x\nflags: POF\noffset 0\n")
    with pytest.raises(LabError, match="did not take"):  # no kernel behind this folder
        arches.ensure("arm64", root, conf)
    assert (root / "qemu-aarch64").read_text() == "-1\n"
    line = (root / "register").read_text().strip()
    assert line.rsplit(":", 1) == [DEBIAN_CONF.rsplit(":", 1)[0], "CFOP"]


def test_no_entry_and_no_qemu_is_one_error_with_the_package_to_install(tmp_path):
    root, conf = fake_binfmt(tmp_path, None)
    (conf / "qemu-aarch64.conf").unlink()
    with pytest.raises(LabError, match="no qemu for arm64 lab hosts") as caught:
        arches.ensure("arm64", root, conf)
    assert caught.value.hint == arches.HINT
    assert (root / "register").read_text() == ""
    (root / "qemu-aarch64").write_text("disabled\nflags: POCF\n")
    assert arches.flags("arm64", root) is None  # a disabled entry counts as none


def test_the_folders_above_an_arm64_root_are_roots_alone(tmp_path):
    """With binfmt's C flag a setuid arm64 binary starts qemu as root, with settings from its
    caller's environment: no other user may reach one (lab/arches.py, NEEDED)."""
    native, arm = tmp_path / "amd64", tmp_path / "arm64"
    for folder in (native, arm):
        folder.mkdir(mode=0o755)
        folder.chmod(0o755)
        arches.confine(folder, folder.name)
    assert (native.stat().st_mode & 0o777, arm.stat().st_mode & 0o777) == (0o755, 0o700)
