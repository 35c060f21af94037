"""The lab's two cached bases: plain, and with the build tools a prepared machine has."""

from __future__ import annotations

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
