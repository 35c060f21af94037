"""Soak the renderers with cluster files that validate accepts; print the figures.

    .venv/bin/python benchmarks/fuzz_render.py [--accepted 2000] [--seed 0]

Documents come from two sources, picked by seed: one in four is the validate fuzz corpus
(tests/support/validate_fuzz.py, mostly refused), the rest are the example inventories with one to four
string fields replaced by hostile-but-valid values (quotes, $(), backticks, ;, %h, $HOME,
spaces, leading dashes, the sentinel PWNED) where the schema lets them through: prefix,
ccache_dir, api_key_file, model path, ollama store, extra_args, cmake_flags values, ssh user,
bind host names, model file names, ref and repo. Each document that load_cluster accepts goes
through every renderer and the checks of tests/support/render_check.py (shared with
tests/unit/test_render_properties.py).

The figures, each with its goal: injections found (a check that names a command, unit or
plist) 0, render errors other than PlanError 0. A finding prints the document's seed and the
offending command; the document is rebuilt from its seed alone (--seed N --accepted 1 ...).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.validate_fuzz import document  # noqa: E402

from meshdeploy.core.loading import load_cluster  # noqa: E402
from meshdeploy.errors import ConfigError  # noqa: E402
from support import render_check as rc  # noqa: E402

INVENTORIES = [YAML(typ="safe").load(p.read_text())
               for p in sorted((REPO / "inventories").glob("*.yaml"))]
# Pieces of hostile values; NOSPACE for fields whose pattern refuses whitespace and quotes.
HOSTILE = ["'", '"', "$(touch PWNED)", "`touch PWNED`", "; touch PWNED", "&& touch PWNED",
           "%h", "%%", "%", "$HOME", "${X}", "$$", " ", "-", "--x=", "*", "?", "~", "#", "=",
           "|", "&", "<", ">", "!", "é", "a", "MESHDEPLOY_EOF", "\\", "]]>"]
NOSPACE = ["$(touch${IFS}PWNED)", "$(id)", "%h", "%%", "$HOME", "${X}", "$$", ";PWNED", "&",
           "|", "-", "=", "!", "(", ")", "<", ">", "#", "'", '"', "`PWNED`", "a"]

MARKS = [b"$", b"`", b"'", b'\\"', b";", b"%", b"PWNED", b"/my "]
HOSTILE_NOTE = "$ ` ' \\\" ; % PWNED, a path with a space"


def hostile(rnd: random.Random, parts=HOSTILE) -> str:
    return "".join(rnd.choice(parts) for _ in range(rnd.randint(1, 4)))


def path_value(rnd: random.Random) -> str:
    return rnd.choice(["/opt/", "/", "/var/lib/my "]) + hostile(rnd) + rnd.choice(["", "/x"])


def host_value(rnd: random.Random) -> str:
    return rnd.choice(["-x", "-", "a-b", "localhost", "h.example", "0-0", "--help"])


# Field editors: (dict of the whole document, rnd) -> None; a KeyError means "not here".
def _each(mapping: dict | None):
    return list((mapping or {}).values())


def edit_prefix(doc, rnd):
    doc["llama_cpp"]["prefix"] = path_value(rnd)


def edit_ccache(doc, rnd):
    doc["llama_cpp"].setdefault("build", {})["ccache_dir"] = path_value(rnd)


def edit_cmake(doc, rnd):
    doc["llama_cpp"].setdefault("build", {})["cmake_flags"] = [
        f"-D{rnd.choice(['X', 'GGML_X:STRING', 'Y_1'])}={hostile(rnd)}"
        for _ in range(rnd.randint(1, 3))]


def edit_ref(doc, rnd):
    doc["llama_cpp"]["ref"] = "b" + hostile(rnd, NOSPACE)


def edit_repo(doc, rnd):
    doc["llama_cpp"]["repo"] = rnd.choice(["git://10.200.0.1/", "https://h/", "/srv/",
                                           "git@h:", "h:"]) + hostile(rnd, NOSPACE)


def edit_ssh_user(doc, rnd):
    host = rnd.choice(_each(doc["hosts"]))
    host.setdefault("ssh", {})["user"] = rnd.choice(["deploy", "", "-"]) + hostile(rnd, NOSPACE)


def edit_rpc_bind(doc, rnd):
    host = rnd.choice([h for h in _each(doc["hosts"]) if h.get("rpc_servers")])
    rnd.choice(host["rpc_servers"])["bind"] = host_value(rnd)


def edit_server(doc, rnd):
    server = rnd.choice(_each(doc["servers"]))
    what = rnd.randrange(3)
    if what == 0:
        server["bind"] = host_value(rnd)
    elif what == 1:
        server["api_key_file"] = path_value(rnd)
    else:
        server["extra_args"] = [rnd.choice(["--x=", "-x", "--", ""]) + hostile(rnd)
                                for _ in range(rnd.randint(1, 4))]


def edit_model(doc, rnd):
    model = rnd.choice(_each(doc["models"]))
    if "huggingface" in model:
        hf = model["huggingface"]
        name = "m" + hostile(rnd).lstrip("/") + ".gguf"
        hf.pop("files", None)
        hf["file"] = name
        hf.pop("sha256", None)
    elif "ollama" in model and isinstance(model["ollama"], dict):
        model["ollama"]["store"] = path_value(rnd)
    else:
        model["path"] = path_value(rnd) + ".gguf"


EDITS = [edit_prefix, edit_ccache, edit_cmake, edit_ref, edit_repo, edit_ssh_user,
         edit_rpc_bind, edit_server, edit_server, edit_model, edit_model]


def hostile_document(rnd: random.Random) -> bytes:
    doc = json.loads(json.dumps(rnd.choice(INVENTORIES)))
    for _ in range(rnd.randint(1, 4)):
        try:
            rnd.choice(EDITS)(doc, rnd)
        except (KeyError, IndexError, TypeError, AttributeError):
            pass  # this inventory has no such field
    return json.dumps(doc, ensure_ascii=False).encode()  # JSON is YAML


def make_document(seed: int) -> bytes:
    rnd = random.Random(seed)
    return document(seed) if rnd.random() < 0.25 else hostile_document(rnd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accepted", type=int, default=2000,
                        help="stop after this many documents validate accepts")
    parser.add_argument("--seed", type=int, default=0, help="first document's seed")
    args = parser.parse_args()

    tried = accepted = marked = rendered = injections = errors = 0
    slowest, slowest_seed = 0.0, None
    started = time.monotonic()
    seed = args.seed
    with tempfile.TemporaryDirectory() as tmp:
        path, scratch = Path(tmp) / "cluster.yaml", Path(tmp) / "scratch"
        scratch.mkdir()
        while accepted < args.accepted:
            seed += 1
            tried += 1
            data = make_document(seed - 1)
            path.write_bytes(data)
            try:
                cluster = load_cluster(path)
            except ConfigError:
                continue
            accepted += 1
            marked += any(m in data for m in MARKS)
            began = time.perf_counter()
            try:
                out = rc.render_all(cluster)
            except Exception:  # noqa: BLE001 - counting these is the point
                errors += 1
                print(f"seed {seed - 1}: render error\n{traceback.format_exc(limit=-3)}",
                      file=sys.stderr)
                continue
            seconds = time.perf_counter() - began
            if seconds > slowest:
                slowest, slowest_seed = seconds, seed - 1
            rendered += 1
            findings = rc.check(cluster, out, scratch)
            injections += bool(findings)
            for finding in findings[:3]:
                print(f"seed {seed - 1}: {finding}", file=sys.stderr)
    total = time.monotonic() - started

    print(f"documents tried:                 {tried:,} (seeds {args.seed}..{seed - 1})")
    print(f"  accepted by validate:          {accepted:,}")
    print(f"    with a hostile value:        {marked:,} (one of: {HOSTILE_NOTE})")
    print(f"  rendered:                      {rendered:,}")
    print(f"injections found:                {injections} (goal 0)")
    print(f"render errors other than PlanError: {errors} (goal 0)")
    print(f"slowest render:                  {slowest:.3f} s (seed {slowest_seed})")
    print(f"total: {total:.0f} s")
    return 1 if injections or errors else 0


if __name__ == "__main__":
    sys.exit(main())
