"""One batched probe per host: every role's facts gathered by a single remote command.

pyinfra runs one remote command per fact; a plan touching a dozen resources on 24 hosts would
pay for hundreds of round trips. Each role still declares small FactBase classes (pure command()
and process()); this module concatenates their commands into one script with section markers
and hands each fact back only its own lines.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from pyinfra.api import FactBase

MARKER = "@@meshdeploy-section "

# Facts whose values move on their own (free disk space); kept out of the drift fingerprint so
# a saved plan is not called stale because a log file grew.
VOLATILE = ("models.DiskFree", "rpc_cache.DeviceMemory", "services.Rtt")


@dataclass
class Section:
    key: str  # unique within a probe, e.g. "models.GgufFile[gemma]"
    fact: type[FactBase]
    kwargs: dict = field(default_factory=dict)

    def script(self) -> str:
        command = self.fact().command(**self.kwargs)
        # A subshell keeps one failing fact (missing binary, absent file) from ending the probe.
        return f"echo '{MARKER}{self.key}'\n( {command}\n) 2>/dev/null\n"


class Probe(FactBase):
    """Runs a composed script; returns {section key: [lines]}.

    ```python
    {"toolchain.Tools": ["cmake", "git"], "llama_cpp.Source": ["<sha>", "<url>"]}
    ```
    """

    def command(self, script: str) -> str:  # type: ignore[override]
        return script

    def process(self, output):
        sections: dict[str, list[str]] = {}
        current = None
        for line in output:
            if line.startswith(MARKER):
                current = line[len(MARKER):].strip()
                sections[current] = []
            elif current is not None:
                sections[current].append(line)
        return sections

    @staticmethod
    def default():
        return {}


def compose(sections: list[Section]) -> str:
    return "".join(section.script() for section in sections)


def decode(sections: list[Section], raw: dict[str, list[str]]) -> dict[str, object]:
    """Each section's lines through its fact's process(); a missing section gives the default."""
    facts: dict[str, object] = {}
    for section in sections:
        fact = section.fact()
        lines = raw.get(section.key)
        facts[section.key] = fact.process(lines) if lines else fact.default()
    return facts


def fingerprint(facts: dict[str, object]) -> str:
    stable = {k: v for k, v in facts.items() if not k.startswith(VOLATILE)}
    blob = json.dumps(stable, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
