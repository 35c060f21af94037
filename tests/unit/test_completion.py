"""TAB completion as a shell does it: bash sources `meshdeploy completion bash` and calls its
completion function with the words typed, which runs meshdeploy under argcomplete."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.require import require

ROOT = Path(__file__).resolve().parents[2]
LAB = "inventories/lab.yaml"


def complete(*words: str) -> list[str]:
    """What bash offers for the last of `words` (an empty last word: after a space)."""
    require("bash")
    script = f"""
eval "$(meshdeploy completion bash)"
COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})
COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))
COMP_LINE={shlex.quote(' '.join(words))}
COMP_POINT=${{#COMP_LINE}}
_python_argcomplete meshdeploy "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [w.strip() for w in out.stdout.splitlines() if w.strip()]


def test_commands_complete():
    assert complete("meshdeploy", "pl") == ["plan"]
    assert "completion" in complete("meshdeploy", "")


def test_limit_offers_the_files_hosts_and_then_the_others():
    assert complete("meshdeploy", "plan", LAB, "--limit", "node") == ["node1", "node2", "node3"]
    assert complete("meshdeploy", "plan", LAB, "--limit", "node1,") == ["node1,node2",
                                                                        "node1,node3"]


def test_target_offers_resource_addresses_of_the_file():
    offered = complete("meshdeploy", "apply", LAB, "-target", "node2/models")
    assert offered == [r"node2/models.gguf\[gemma\]"]  # bash escapes the brackets
    assert "network.allowlist" in complete("meshdeploy", "plan", LAB, "-replace", "network.")


def test_logs_offers_hosts_services_and_servers():
    offered = complete("meshdeploy", "logs", LAB, "")
    assert {"node1", "node2", "node3", "rpc-server", "llama-server", "main"} <= set(offered)


def test_a_broken_file_completes_resource_names_and_no_hosts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [\n")
    assert complete("meshdeploy", "plan", str(bad), "--limit", "") == []
    assert "llama_cpp.build" in complete("meshdeploy", "plan", str(bad), "-target", "llama")


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_each_shell_gets_a_script_naming_meshdeploy(shell):
    from support.cli import meshdeploy

    out = meshdeploy("completion", shell)
    assert out.returncode == 0 and "meshdeploy" in out.stdout and "_ARGCOMPLETE" in out.stdout
