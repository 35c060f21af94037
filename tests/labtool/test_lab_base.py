"""The lab's two cached bases: plain, and with the build tools a prepared machine has."""

from __future__ import annotations

import os
import shutil
import subprocess

from support.require import unmet

from meshdeploy.lab import base
from meshdeploy.roles.toolchain import defaults


def test_the_toolchain_base_is_a_recipe_of_its_own():
    plain, tools = base.recipe(), base.recipe(toolchain=True)
    assert base.recipe_hash(plain) != base.recipe_hash(tools)
    assert base.base_dir(spec=plain) != base.base_dir(spec=tools)
    assert tools["packages"] == plain["packages"] + list(base.TOOLCHAIN)
    assert not set(base.TOOLCHAIN) & set(plain["packages"])


def test_the_toolchain_base_has_every_package_the_toolchain_role_installs_on_debian():
    wanted = set(defaults.toolchain_apt_packages) | {defaults.toolchain_ccache_package}
    assert wanted <= set(base.recipe(toolchain=True)["packages"])


def test_bookworm_bases_keep_the_recipes_and_caches_they_had_before_suites():
    # The hashes of the three bookworm recipes as they were before suites existed: a change
    # here would debootstrap every lab's base again.
    assert [base.recipe_hash(base.recipe(*flags)) for flags in
            ((False, False), (True, False), (True, True))] == [
        "f78d958b0eaef8ba", "1cc1ccccd5b4963a", "e0e48492f6be34dc"]
    assert base.recipe(suite="bookworm") == base.recipe()


def test_each_release_is_a_recipe_of_its_own_from_its_own_apt_sources():
    recipes = {suite: base.recipe(toolchain=True, suite=suite) for suite in base.SUITES}
    assert len({base.recipe_hash(r) for r in recipes.values()}) == 3
    for suite, spec in recipes.items():
        assert spec["suite"] == suite
        sources = spec["setup"].split("EOF\n")[0].splitlines()[-3:]
        assert sources == [f"deb http://deb.debian.org/debian {suite} main",
                           f"deb http://deb.debian.org/debian {suite}-updates main",
                           f"deb http://deb.debian.org/debian-security {suite}-security main"]
    # Debian 11 has no wireguard-go; everything else is the same list.
    assert "wireguard-go" not in recipes["bullseye"]["packages"]
    assert recipes["bullseye"]["packages"] == [p for p in recipes["trixie"]["packages"]
                                               if p != "wireguard-go"]


def test_unknown_releases_and_hosts_are_refused_naming_them():
    import pytest

    from meshdeploy.lab import Lab
    from meshdeploy.lab.cli import main
    from meshdeploy.lab.errors import LabError

    assert base.resolve_suites({"node2": "trixie"}, ["node1", "node2"]) == {
        "node1": "bookworm", "node2": "trixie"}
    with pytest.raises(LabError, match="node2: unknown Debian release 'buster'.*bullseye"):
        Lab(name="mdsx", hosts=2, suites={"node2": "buster"})
    with pytest.raises(LabError, match="node4, not a host of this lab"):
        Lab(name="mdsx", hosts=2, suites={"node4": "trixie"})
    with pytest.raises(LabError, match="unknown Debian release 'sid'"):
        base.recipe(suite="sid")
    assert main(["up", "--name", "mdsx", "--suite", "node2"]) == 1
    assert main(["up", "--name", "mdsx", "--suite", "node1=sid"]) == 1


def test_a_running_host_asked_for_another_release_is_named_with_both():
    from meshdeploy.lab.core import _differs

    assert _differs("node2", ("root", "bullseye"), ("root", "trixie")) == \
        "node2 is bullseye, not trixie"
    assert _differs("node2", ("termux", "bookworm"), ("root", "bookworm")) == \
        "node2 is termux, not root"


def test_a_build_writes_a_folder_of_its_own_and_removes_earlier_runs_folders(tmp_path, monkeypatch):
    """A debootstrap left running by a killed run keeps writing into `base-X.tmp...`; the next
    build removes such folders and builds in one named after its own process, so the two never
    write into one folder, and only a finished build is renamed into place."""
    final = tmp_path / "base-0123456789abcdef"
    stale = [tmp_path / f"{final.name}.tmp", tmp_path / f"{final.name}.tmp-1"]
    for folder in stale:
        (folder / "rootfs").mkdir(parents=True)
        (folder / "rootfs" / "half-written").write_text("x")
    seen = []

    def fake_run(argv, logfile, what):
        seen.append((what, logfile.parent.name))
        logfile.write_text("")

    monkeypatch.setattr(base, "_run", fake_run)
    base._build(final, base.recipe(), log=lambda line: None)
    assert [w for w, _ in seen] == ["debootstrap", "setup"]
    assert {folder for _, folder in seen} == {f"{final.name}.tmp-{os.getpid()}"}
    assert not any(folder.exists() for folder in stale)
    assert (final / "complete").is_file() and (final / "recipe.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def _bind(source, target) -> None:
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True)


def test_a_stale_build_folder_goes_without_anything_mounted_under_it_being_emptied(tmp_path):
    """A base build killed in debootstrap's second stage leaves mounts under its .tmp folder; the
    next build removes that folder. Removing it by walking the tree deletes what is mounted there
    (shown first, with a bind of a folder standing for the machine's own); remove_tree unmounts
    first and keeps to the folder's file system."""
    if os.geteuid() != 0:
        unmet("mounting a folder needs root")
    outside = tmp_path / "the machine's"
    outside.mkdir()
    stale = tmp_path / "base-x.tmp-1"
    target = stale / "rootfs" / "dev"
    target.mkdir(parents=True)
    try:
        (outside / "keep").write_text("x")
        _bind(outside, target)
        shutil.rmtree(stale, ignore_errors=True)  # the walk reaches through the mount
        assert not (outside / "keep").exists()
        subprocess.run(["umount", "-l", str(target)], check=True)

        (outside / "keep").write_text("x")
        target.mkdir(parents=True, exist_ok=True)
        _bind(outside, target)
        base.remove_tree(stale)
        assert (outside / "keep").read_text() == "x"
        assert not stale.exists()
        assert str(target) not in open("/proc/self/mounts").read()
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_a_stale_build_folder_that_is_a_link_goes_alone(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    link = tmp_path / "base-x.tmp-2"
    link.symlink_to(elsewhere)
    base.remove_tree(link)
    assert not link.is_symlink() and (elsewhere / "keep").read_text() == "x"
