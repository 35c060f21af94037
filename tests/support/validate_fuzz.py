"""Cluster files for fuzzing `meshdeploy validate`: the example inventories mutated, and
documents generated around the schema's keys.

Shared by tests/unit/test_validate_properties.py (hypothesis, a fixed budget in CI) and
benchmarks/fuzz_validate.py (the soak run that prints the figures). Every function takes a
random.Random, so a document is reproduced from its seed alone.
"""

from __future__ import annotations

import json
import random
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from meshdeploy.core.loading import load_cluster
from meshdeploy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [p.read_text() for p in sorted((ROOT / "inventories").glob("*.yaml"))]


def schema_keys() -> list[str]:
    keys: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            keys.update(node.get("properties", {}))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads((ROOT / "schemas" / "cluster.schema.json").read_text()))
    return sorted(keys) + ["x-a", "x-ssh", "<<"]


KEYS = schema_keys()

# Scalars that have crashed, hung or slipped past validate before, and their neighbours.
NASTY = [
    "", "~", "null", "true", "no", "yes", "on", "0", "-1", "50052.0", "1e999", "-.inf", ".nan",
    ".NaN", "0x1F", "0o17", "1_000", "2024-01-01", "12:30:00", "'quoted'", '"dq\\n"',
    '"\\x07bell"', '"\\u0085"', '"\\t"', "!!bool x", "!!int x", "!!float x", "!!null x",
    "!!str 5", "!!set {a, b}", "!!binary aGVsbG8=", "!!python/object:os.system x",
    "!!omap [{a: 1}]", "!!timestamp x", "!!map x", "!!seq {a: 1}", "!foo bar", "! 5",
    "*undefined", "&a 1", "[*a]", "{<<: 5}", "{<<: [1]}", "'%s'", "'%n%%'", "$HOME", "${X}",
    "'--upload-pack=touch /tmp/x'", "'x; reboot'", "'1.2.3.4; reboot'", "../../etc/passwd",
    "/opt/my models", "/a//b", "/a/../b", "'-x'", "ext::sh", "git@host:x.git",
    "'http://x\"; APT::Update::Pre-Invoke {\"sh\";};'", "|\n  multi\n  line\n", ">-\n  folded\n",
    "1" * 4301, "1" * 400, "9" * 30, "@{u}", "a..b", "x.lock", "'\u202e'", "\u00e9t\u00e9",
]
CONTROL = [chr(c) for c in list(range(0, 32)) + [127, 0x85, 0x9F, 0xFEFF, 0x2028, 0xFFFE]]
JUNK = [b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x1b[31m", b"\r", b"\r\n", b"\t"]


def random_scalar(rnd: random.Random) -> str:
    roll = rnd.random()
    if roll < 0.45:
        return rnd.choice(NASTY)
    if roll < 0.6:
        return str(rnd.choice([rnd.randint(-10, 70000), rnd.random() * 10, 2 ** 64]))
    alphabet = "abcXYZ019 -_./:@%$'\"\\#&*!|>{}[],?~^"
    if rnd.random() < 0.6:  # double-quoted, so control characters arrive escaped
        alphabet += "".join(CONTROL[:12])
        return json.dumps("".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 24))))
    return "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 24)))


def random_value(rnd: random.Random, depth: int = 0) -> str:
    """A YAML flow value: scalar, list or mapping, keys from the schema."""
    roll = rnd.random()
    if depth > 3 or roll < 0.5:
        return random_scalar(rnd)
    if roll < 0.75:
        return "[" + ", ".join(random_value(rnd, depth + 1)
                               for _ in range(rnd.randint(0, 4))) + "]"
    return "{" + ", ".join(f"{rnd.choice(KEYS)}: {random_value(rnd, depth + 1)}"
                           for _ in range(rnd.randint(0, 4))) + "}"


def alias_bomb(levels: int, width: int) -> str:
    lines = ["x-l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"x-l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


# -- mutations: text -> text (bytes only at the very end, by insert_bytes) -------------------

def replace_value(text: str, rnd: random.Random) -> str:
    lines = text.split("\n")
    spots = [i for i, line in enumerate(lines)
             if ": " in line and not line.lstrip().startswith("#")]
    if not spots:
        return text
    i = rnd.choice(spots)
    head = lines[i][: lines[i].index(": ") + 2]
    lines[i] = head + random_value(rnd)
    return "\n".join(lines)


def replace_key(text: str, rnd: random.Random) -> str:
    lines = text.split("\n")
    spots = [i for i, line in enumerate(lines) if ":" in line and not line.lstrip().startswith("#")]
    if not spots:
        return text
    i = rnd.choice(spots)
    indent = len(lines[i]) - len(lines[i].lstrip())
    key = rnd.choice(KEYS + ["? [a, b]", "null", "1", "true", "1.5", "''", "'a:b'", "a b",
                             "[x]", "{y: 1}", "\"\\n\"", "-x", "*a"])
    lines[i] = " " * indent + key + ":" + lines[i].split(":", 1)[1]
    return "\n".join(lines)


def duplicate_line(text: str, rnd: random.Random) -> str:
    lines = text.split("\n")
    i = rnd.randrange(len(lines))
    lines.insert(i, lines[i])
    return "\n".join(lines)


def delete_line(text: str, rnd: random.Random) -> str:
    lines = text.split("\n")
    del lines[rnd.randrange(len(lines))]
    return "\n".join(lines)


def reindent(text: str, rnd: random.Random) -> str:
    lines = text.split("\n")
    i = rnd.randrange(len(lines))
    lines[i] = " " * rnd.choice([0, 1, 3, 8]) + lines[i].lstrip()
    return "\n".join(lines)


def insert_char(text: str, rnd: random.Random) -> str:
    i = rnd.randrange(len(text) + 1)
    chars = CONTROL if rnd.random() < 0.3 else list("'\"[]{}:#&*!|>%@`,-? \t\\")
    return text[:i] + rnd.choice(chars) + text[i:]


def truncate(text: str, rnd: random.Random) -> str:
    return text[: rnd.randrange(len(text) + 1)]


def add_top(text: str, rnd: random.Random) -> str:
    """A top-level addition: anchors and aliases, bombs, nesting, directives, big lists."""
    choice = rnd.randrange(12)
    if choice == 0:
        return text + alias_bomb(rnd.randint(2, 9), rnd.randint(2, 12))
    if choice == 1:
        return text + "x-r: &r [*r]\n" if rnd.random() < 0.5 else text + "x-r: &r {a: *r}\n"
    if choice == 2:
        n = rnd.choice([10, 63, 64, 65, 200, 1000, 5000])
        open_, close = rnd.choice([("[", "]"), ("{a: ", "}"), ("- ", "")])
        if open_ == "- ":
            body = "".join("  " * i + "- \n" for i in range(min(n, 300)))
            return text + "x-deep:\n" + body
        return text + f"x-deep: {open_ * n}1{close * n}\n"
    if choice == 3:
        version = rnd.choice(["1.1", "1.2", "1.3", "2.0", "1.x", "1", "0.9"])
        return f"%YAML {version}\n---\n" + text
    if choice == 4:
        return "%TAG !e! tag:example.com,2000:\n---\n" + text + "x-t: !e!thing 1\n"
    if choice == 5:
        n = rnd.choice([100, 9_999, 10_001, 100_000])
        return text + "x-list: [" + ",".join(["1"] * n) + "]\n"
    if choice == 6:
        return text + rnd.choice(["---\nb: 1\n", "...\n", "--- |\n  x\n"])
    if choice == 7:
        return text + f"x-s: &s {random_value(rnd)}\nx-u: [*s, *s]\n"
    if choice == 8:
        return text + "# " + "c" * rnd.choice([100, 10_000, 200_000]) + "\n"
    if choice == 9:
        return text + rnd.choice(["? [a, b]\n: 1\n", "null: 1\n", "1: x\n", "true: x\n",
                                  "? {a: 1}\n: 2\n", "2024-01-01: d\n"])
    if choice == 10:
        return text + "x-merge:\n  <<: " + rnd.choice(["5", "[1]", "*nope", "{a: 1}"]) + "\n"
    return text + f"{rnd.choice(KEYS)}: {random_value(rnd)}\n"


MUTATIONS = [replace_value, replace_value, replace_key, duplicate_line, delete_line, reindent,
             insert_char, truncate, add_top, add_top]


def mutated(rnd: random.Random) -> bytes:
    text = rnd.choice(SEEDS)
    for _ in range(rnd.randint(1, 4)):
        text = rnd.choice(MUTATIONS)(text, rnd)
    data = text.encode("utf-8", "surrogatepass")
    if rnd.random() < 0.08:  # bytes that are not UTF-8, or binary junk outright
        i = rnd.randrange(len(data) + 1)
        junk = rnd.choice(JUNK) if rnd.random() < 0.8 else rnd.randbytes(rnd.randint(1, 64))
        data = data[:i] + junk + data[i:]
    return data


def generated(rnd: random.Random) -> bytes:
    """A document built from scratch: top-level schema keys with random values."""
    lines = []
    for _ in range(rnd.randint(0, 8)):
        key = rnd.choice(KEYS)
        if rnd.random() < 0.5:
            lines.append(f"{key}: {random_value(rnd)}")
        else:
            lines.append(f"{key}:")
            for _ in range(rnd.randint(0, 4)):
                lines.append(f"  {rnd.choice(KEYS + ['node1', 'm'])}: {random_value(rnd)}")
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


# -- documents shaped like a cluster file: they pass the schema and reach the semantic checks --

ADDRESSES = ["10.0.0.1", "10.0.0.2", "127.0.0.1", "192.168.1.5", "203.0.113.7", "0.0.0.0",
             "::1", "fd00::1", "1", "5", "node1.lan", "gpu-01", "localhost", "10.0.0.1.5"]
PORTS = [0, 1, 2, 22, 80, 1023, 1024, 8080, 50052, 50053, 51820, 65535]


def _maybe(rnd: random.Random, line: str, p: float = 0.5) -> list[str]:
    return [line] if rnd.random() < p else []


def _host(rnd: random.Random, name: str) -> list[str]:
    """A host, its keys left out as often as given (no backend, no ssh, no rpc-servers)."""
    lines = [f"  {name}:", f"    address: {json.dumps(rnd.choice(ADDRESSES))}"]
    lines += _maybe(rnd, f"    backend: {rnd.choice(['cpu', 'cuda', 'metal', 'vulkan', 'rocm'])}")
    lines += _maybe(rnd, f"    connection: {rnd.choice(['ssh', 'local'])}", 0.2)
    lines += _maybe(rnd, f"    rootless: {rnd.choice(['true', 'false'])}", 0.3)
    lines += _maybe(rnd, f"    unprotected: {rnd.choice(['true', 'false'])}", 0.15)
    if rnd.random() < 0.4:
        lines += ["    ssh:", f"     user: {rnd.choice(['n', 'root', 'deploy'])}"]
        lines += _maybe(rnd, f"     sudo: {rnd.choice(['true', 'false'])}", 0.3)
        lines += _maybe(rnd, f"     port: {rnd.choice(PORTS)}", 0.3)
    if rnd.random() < 0.6:
        lines.append("    rpc_servers:")
        for _ in range(rnd.randint(0, 3)):
            rpc = [f"port: {rnd.choice(PORTS)}"]
            rpc += _maybe(rnd, f"bind: {json.dumps(rnd.choice(ADDRESSES))}", 0.3)
            rpc += _maybe(rnd, f"cache: {rnd.choice(['true', 'false'])}", 0.4)
            rpc += _maybe(rnd, f"fetch: {rnd.choice(['true', 'false'])}", 0.2)
            rpc += _maybe(rnd, f"device: {rnd.choice(['CPU', 'CUDA0', 'Vulkan0', 'x'])}", 0.2)
            lines.append("    - {" + ", ".join(rpc) + "}")
    return lines


def _model(rnd: random.Random, name: str) -> list[str]:
    kind = rnd.randrange(4)
    if kind == 0:
        repo = json.dumps(rnd.choice(["h/L", "a/b"]))
        lines = [f" {name}:", "  huggingface:", f"   repo: {repo}"]
        lines += _maybe(rnd, f"   file: {rnd.choice(['m.gguf', 'x.bin', '../m.gguf'])}")
        return lines
    if kind == 1:
        return [f" {name}:", f"  path: {rnd.choice(['/m.gguf', 'm.gguf', '/opt/x'])}"]
    if kind == 2:
        return [f" {name}:", f"  ollama: {{model: {rnd.choice(['gemma3', 'a:b', 'x/y'])}}}"]
    return [f" {name}: {{}}"]


def _server(rnd: random.Random, name: str, hosts: list[str], models: list[str],
            rpcs: list[str]) -> list[str]:
    lines = [f" {name}:", f"    host: {rnd.choice(hosts + ['nowhere'])}",
             f"    model: {rnd.choice(models + ['missing'])}"]
    lines += _maybe(rnd, f"    port: {rnd.choice(PORTS)}", 0.3)
    lines += _maybe(rnd, f"    bind: {json.dumps(rnd.choice(ADDRESSES))}", 0.2)
    if rnd.random() < 0.5:
        refs = rnd.sample(rpcs + ["nowhere:1"], rnd.randint(0, min(3, len(rpcs) + 1)))
        lines.append(f"    rpc: {json.dumps(refs) if refs or rnd.random() < 0.5 else 'none'}")
    lines += _maybe(rnd, f"    placement: {rnd.choice(['memory', 'auto'])}", 0.2)
    lines += _maybe(rnd, f"    tensor_split: {rnd.choice(['auto', '[1, 1]', '[0, 1]'])}", 0.2)
    lines += _maybe(rnd, f"    allow_unauthenticated: {rnd.choice(['true', 'false'])}", 0.2)
    return lines


def structured(rnd: random.Random) -> bytes:
    """A file shaped like a cluster file, as the one the fuzzing run found validate crashing
    on: hosts without a backend, an rpc-server on a low port or a DNS-named host, servers
    naming hosts, models and rpc-servers that may not exist, a network section or none."""
    hosts = [rnd.choice(["i", "x", "node1", "node2", "n"]) + str(k)
             for k in range(rnd.randint(1, 4))]
    models = [f"m{k}" for k in range(rnd.randint(0, 2))]
    lines = [f"cluster: {json.dumps(rnd.choice(['b', 'lab', 'c-1']))}", "llama_cpp:",
             f" ref: {rnd.choice(['L', 'b11312', 'main'])}", "hosts:"]
    for name in hosts:
        lines += _host(rnd, name)
    rpcs = [f"{h}:{p}" for h in hosts for p in rnd.sample(PORTS, 2)]
    if models:
        lines.append("models:")
        for name in models:
            lines += _model(rnd, name)
    if rnd.random() < 0.8:
        lines.append("servers:")
        for k in range(rnd.randint(1, 3)):
            lines += _server(rnd, f"s{k}", hosts, models, rpcs)
    if rnd.random() < 0.5:
        lines += ["network:", f"  transport: {rnd.choice(['plain', 'wireguard', 'ssh'])}"]
        lines += _maybe(rnd, f"  rpc_bind: {rnd.choice(['address', 'loopback'])}")
        lines += _maybe(rnd, f"  firewall: {rnd.choice(['true', 'false'])}", 0.3)
        lines += _maybe(rnd, f"  allow_public: {rnd.choice(['true', 'false'])}", 0.3)
    return ("\n".join(lines) + "\n").encode()


def document(seed: int) -> bytes:
    rnd = random.Random(seed)
    roll = rnd.random()
    return mutated(rnd) if roll < 0.65 else generated(rnd) if roll < 0.8 else structured(rnd)


# -- checking one document --------------------------------------------------------------------

FILE_LEVEL = ("cannot read", "is larger than")  # the only issues without a line:col


class Hang(Exception):
    pass


@contextmanager
def hang_guard(seconds: int):
    """Turns a validate that runs past `seconds` into Hang (SIGALRM; main thread only)."""
    def alarm(_signum, _frame):
        raise Hang(f"validate ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    seconds: float
    valid: bool
    problems: list[str]  # broken promises: unlocated or multi-line issues


def check(path: Path) -> Outcome:
    """Validate one file; anything but success or a well-formed ConfigError propagates."""
    started = time.perf_counter()
    try:
        load_cluster(path)
        return Outcome(time.perf_counter() - started, True, [])
    except ConfigError as exc:
        seconds = time.perf_counter() - started
        return Outcome(seconds, False, issue_problems(str(path), exc))


def issue_problems(display: str, exc: ConfigError) -> list[str]:
    problems = []
    for issue in exc.issues:
        text = issue.render()
        if issue.file != display:
            problems.append(f"names {issue.file!r}, not the file: {text}")
        if issue.line == 0 and not issue.message.startswith(FILE_LEVEL):
            problems.append(f"no line:col: {text}")
        if issue.line < 0 or (issue.line and issue.col < 1):
            problems.append(f"bad position: {text}")
        if "\n" in str(issue) or any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in text
                                     if c != "\n"):
            problems.append(f"not one clean line: {text!r}")
    return problems
