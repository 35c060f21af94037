"""bench --sweep's machinery: each device's speed, fitted to measured layer splits (the command's
part, its checks, confirmation, locks and views, is meshdeploy.commands.bench's run_sweep).

The deployed llama-server is stopped (an rpc-server serves one client at a time), and copies of
it with other -ts values run one after the other as a transient unit on a free loopback port of
the orchestrator (server_api.Copy, as --compare-local runs its copy); each is measured as bench
measures, stopped, and the deployed server is started again in every case. Every split's
weight bytes per device and its seconds per token are the points placement.speed fits;
the fit is kept by engine.speeds for placement: auto. Views: meshdeploy.views.sweep.

The sweep holds the host locks of the server's hosts throughout (engine.locks, as apply does),
so no apply changes the cluster under it. What brings the deployed server back when the sweep
cannot (a dead-man timer on the orchestrator; SIGTERM and SIGHUP): engine.sweep_guard. The
copies run in the deployed unit's sandbox, from the argv the plan renders
(server_api.planned_argv), and the API key goes only to a listener of the unit meant.

The placement's model reader (placement.tensors: urllib, so ssl) and engine.speeds are imported
where they are used: the command line imports this module (through commands.bench) to build its
parser, before gevent's patch, and its other commands need neither.
"""

from __future__ import annotations

from datetime import datetime, timezone

from meshdeploy.config.addresses import local_address
from meshdeploy.core import rpc_hello, shell
from meshdeploy.engine import server_api, sweep_guard
from meshdeploy.placement import speed
from meshdeploy.placement.layers import place

POINTS = 7
MIN_RESTART_AFTER = 30
UNIT = "meshdeploy-sweep-{name}"
# How far a candidate moves layers toward one device: the share of every other device's layers
# it takes. Mild first, so that the first few candidates already tell every device apart.
STRENGTHS = (0.3, 0.6, 0.85)
_SPLIT_FLAGS = ("-ts", "--tensor-split")
_GPU_LAYERS = ("-ngl", "--gpu-layers", "--n-gpu-layers")


# -- the splits ----------------------------------------------------------------------------------

def apportion(total: int, weights: list[float], minimum: int = 1) -> list[int]:
    """`total` whole slots in proportion to `weights` (largest remainder), each at least
    `minimum` while there are enough slots for that."""
    n = len(weights)
    floor = minimum if total >= minimum * n else 0
    whole = sum(weights) or 1.0
    spare = [max(w * total / whole - floor, 0.0) for w in weights]
    left = total - floor * n
    scale = left / sum(spare) if sum(spare) > 0 else 0.0
    exact = [s * scale for s in spare]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:left - sum(counts)]:
        counts[i] += 1
    return [floor + c for c in counts]


def candidates(n_layers: int, labels: list[str], count: int,
               n_gpu_layers: int | None = None) -> list[tuple[list[int], object]]:
    """Up to `count` (-ts values, Placement) pairs whose placements all differ: the even split,
    then, at each of STRENGTHS in turn, a split moved toward each device.

    The values are layer counts over llama.cpp's n_layers + 1 slots (the output takes one), so
    place() lands them exactly. Every device keeps at least one slot where there are enough.
    With at least one more split than devices, the byte counts the splits give are linearly
    independent (their sum is the model's, so distinct splits never lie on one line through
    zero), which speed.fit's rank check needs."""
    slots, n = n_layers + 1, len(labels)
    even = [slots / n] * n
    weights = [even]
    for strength in STRENGTHS:
        for d in range(n):
            weights.append([(1 - strength) * w + (strength * slots if i == d else 0.0)
                            for i, w in enumerate(even)])
    out, seen = [], set()
    for w in weights:
        ts = apportion(slots, w)
        placement = place(n_layers, labels, ts, n_gpu_layers=n_gpu_layers)
        key = (placement.layer_device, placement.output_device)
        if key not in seen:
            seen.add(key)
            out.append((ts, placement))
        if len(out) == count:
            break
    return out


def with_split(argv: list[str], ts: list[int]) -> list[str]:
    """argv with its -ts/--tensor-split value (either spelling, `--tensor-split=` too) replaced
    by `ts`, or -ts added when it has none."""
    value = ",".join(str(v) for v in ts)
    out, i, found = [], 0, False
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        if name in _SPLIT_FLAGS:
            out += [f"{name}={value}"] if eq else [name, value]
            i, found = i + (1 if eq else 2), True
            continue
        out.append(argv[i])
        i += 1
    return out if found else out + ["-ts", value]


def gpu_layers(argv: list[str]) -> int | None:
    """-ngl of argv as place() takes it: None for every layer (absent, negative, or a word such
    as `all` or `auto`)."""
    for i, flag in enumerate(argv):
        name, eq, inline = flag.partition("=")
        if name in _GPU_LAYERS:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                return int(value) if int(value) >= 0 else None
            except ValueError:
                return None
    return None


# -- the fit ------------------------------------------------------------------------------------

def _rate(fit, held, rtt: tuple[float, ...] = ()) -> float | None:
    seconds = fit.seconds(held, rtt) if fit is not None else 0.0
    return 1.0 / seconds if seconds > 0 else None


def held_out(devices, points: list, rtt: tuple[float, ...] = ()) -> list[dict]:
    """Each point's tokens/s predicted by a fit of the other points only ({"gen", "prompt"};
    None where the others cannot be fitted), so no prediction has seen what it predicts."""
    out = []
    for i, point in enumerate(points):
        try:
            others = points[:i] + points[i + 1:]
            if len(others) < len(devices):
                raise ValueError("fewer points than devices")
            cal = speed.calibrate(devices, "", "", others, rtt)
        except ValueError:
            out.append({"gen": None, "prompt": None})
            continue
        # A prompt's round trips are paid per batch, not per token: the prompt fit has none.
        out.append({"gen": _rate(cal.gen, point.bytes, rtt),
                    "prompt": _rate(cal.prompt, point.bytes)})
    return out


def read_model(conn, path: str) -> tuple[dict, list]:
    """(model_shape, weight_tensors) of the GGUF at `path` on the orchestrator, from its header
    only, read over the bench's connection (SFTP; a local host's file directly), as a plan
    reads a model that is only on a host."""
    from meshdeploy.core.gguf import GgufHeaderError, parse_header
    from meshdeploy.placement.tensors import header_bytes, model_shape, weight_tensors

    where = f"{conn.settings.host}:{path}"
    try:
        if conn.settings.local:
            with open(path, "rb") as f:
                data = header_bytes(f, where)
        else:
            with conn.sftp().open(path, "rb") as f:
                data = header_bytes(f, where)
    except OSError as exc:
        raise server_api.BenchError(f"{where}: {exc.strerror or exc}",
                                    hint="the sweep reads the model's header as the SSH "
                                         "user") from None
    header = parse_header(data)
    if header is None:
        raise GgufHeaderError(f"{where}: no complete GGUF header")
    return model_shape(header), weight_tensors(header)


# -- one server ---------------------------------------------------------------------------------

def _measure_split(conn, copy: server_api.Copy, argv: list[str], ts: list[int], key, server,
                   runs: int, progress) -> dict:
    """One candidate on a free port: its bench summary, or {"error": why it was not measured}."""
    port = server_api.free_port(conn)
    split_argv = with_split(server_api.local_argv(argv, port, copy.key_path, drop=frozenset()),
                            ts)
    try:
        copy.start(split_argv)
        api = copy.api(port, key)
        api.wait_healthy(server.health.retries * server.health.interval + 30, alive=copy.active)
        return server_api.measure(api, runs, server_api.N_PREDICT, progress)
    except Exception as exc:  # HTTP, SSH channel and socket failures come in many classes
        return {"error": f"{exc} (see `journalctl -u {copy.unit}`)"}
    finally:
        copy.stop()


# One RPC round trip, timed on the orchestrator: HELLO and its reply, on a fresh connection
# each time, ROUNDS times per worker; the median in seconds, or "-" where none completed.
# Through the worker's --rpc address, so an SSH forward's own hops are in it. Arguments:
# ROUNDS, then one address:port per worker.
_RTT = rpc_hello.FUNCTIONS + r"""
rounds = int(sys.argv[1])
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    times = []
    for _ in range(rounds):
        try:
            with socket.create_connection((host, int(port)), timeout=2) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t = time.perf_counter()
                hello(s)
                times.append(time.perf_counter() - t)
        except (OSError, EOFError):
            pass
    times.sort()
    print(times[len(times) // 2] if times else "-")
"""
RTT_ROUNDS = 15


def round_trips(conn, cluster, server) -> tuple[float, ...]:
    """Seconds of one RPC round trip from the orchestrator to each of `server`'s devices (in
    server_devices order; 0.0 for a local device, and for a worker none was measured to).
    Run while the deployed server is stopped: an rpc-server answers one client at a time."""
    devs = cluster.server_devices(server)
    targets = list(dict.fromkeys(e.target for *_, e in devs if e is not None))
    if not targets:
        return tuple(0.0 for _ in devs)
    try:
        out = server_api.run_remote(conn, shell.command("python3", "-c", _RTT, RTT_ROUNDS,
                                                        *targets))
    except server_api.BenchError:  # no python3 there: the fit carries the round trips
        out = ""
    lines = out.split()
    measured = {}
    for target, line in zip(targets, lines):
        try:
            measured[target] = max(float(line), 0.0)
        except ValueError:
            measured[target] = 0.0
    return tuple(0.0 if e is None else measured.get(e.target, 0.0) for *_, e in devs)


def _say(progress, line: str) -> None:
    try:
        progress(line)
    except OSError:  # after SIGHUP the terminal may be gone: the server is started all the same
        pass


def _sweep(conn, sudo: bool, cluster, server, key, argv: list[str], splits, runs: int,
           progress, first=None, last=None, seconds: int = sweep_guard.SECONDS) -> list:
    """Every split measured with the deployed server stopped; that server started again and
    healthy afterwards, also when a split or the sweep itself fails, or SIGTERM or SIGHUP
    ends it; and by the orchestrator itself `seconds` after the last step began when the sweep
    cannot (sweep_guard.Deadman).
    + first, last: called while the server is stopped, before the splits (round_trips) and
      after them (the model on the orchestrator alone)"""
    copy = server_api.Copy(conn, sudo, cluster, server, UNIT.format(name=server.name), key)
    odd = copy.refusal(with_split(server_api.local_argv(argv, 1, copy.key_path,
                                                        drop=frozenset()), [1]))
    if odd is not None:
        raise server_api.BenchError(f"servers.{server.name}: {odd}",
                                    hint="the sweep starts copies of the running server as "
                                         "transient units; remove the character")
    deployed = server_api.Api(conn, local_address(server.bind), server.port, key,
                              unit=server.unit_name, sudo=sudo)
    guard = sweep_guard.Deadman(conn, sudo, server, seconds,
                                [copy.unit, server_api.LOCAL_UNIT.format(name=server.name)])

    def step() -> None:
        guard.arm()
        if guard.fired():
            raise server_api.BenchError(
                f"{server.unit_name} on {server.host} runs again in the middle of the sweep: "
                f"a step took longer than --restart-after {seconds} s, and the orchestrator "
                "started it as the sweep had asked", hint="give a longer --restart-after")

    measured = []
    guard.cancel()  # one a killed sweep left
    with sweep_guard.interruptible():
        try:
            guard.arm()
            progress(f"stopping {server.unit_name} on {server.host} for the sweep (the "
                     f"orchestrator starts it by itself if the sweep is cut off for {seconds} s)")
            server_api.run_remote(conn, shell.command("systemctl", "stop", server.unit_name),
                                  sudo)
            if first is not None:
                first()
            for i, (ts, _) in enumerate(splits, 1):
                step()
                progress(f"split {i}/{len(splits)}: -ts {','.join(map(str, ts))}")
                measured.append(_measure_split(conn, copy, argv, ts, key, server, runs,
                                               progress))
            if last is not None:
                step()
                last()
        finally:
            with sweep_guard.uninterrupted():
                _say(progress, f"starting {server.unit_name} on {server.host} again")
                try:
                    server_api.run_remote(conn, shell.command("systemctl", "start",
                                                              server.unit_name), sudo)
                    guard.cancel()
                except Exception as exc:  # the SSH connection is gone, most likely
                    raise server_api.BenchError(
                        f"{server.host}: could not start {server.unit_name} again: {exc}",
                        hint=f"the orchestrator starts it by itself within {seconds} s "
                             f"(systemd timer {guard.names[guard.armed or 0]})") from None
            deployed.wait_healthy(server.health.retries * server.health.interval + 30)
    return measured


def _fit(labels, build: dict, tensors, shape: dict, splits, measured,
         rtt: tuple[float, ...] = ()) -> tuple[dict, list, list]:
    """(kept entry or {"error": why not}, the rows of every split, the loaded points).
    + rtt: seconds of one RPC round trip to each device (0 for a local one), or () unmeasured"""
    rows, points = [], []
    for (ts, placement), result in zip(splits, measured):
        row = {"ts": ts, "layers": [len(placement.layers_of(i)) for i in range(len(labels))],
               "placement": placement.describe(), "held_bytes": list(speed.held_bytes(
                   placement, shape))}
        if "error" in result:
            rows.append({**row, "loaded": False, "error": result["error"]})
            continue
        gen, prompt = (result["overall"][m]["median"] for m in ("tg", "pp"))
        rows.append({**row, "loaded": True, "measured": {"gen": gen, "prompt": prompt}})
        points.append(speed.Point(tuple(row["held_bytes"]), 1.0 / gen,
                                  1.0 / prompt if prompt > 0 else None))
    loaded = [r for r in rows if r["loaded"]]
    for row, predicted in zip(loaded, held_out(labels, points, rtt)):
        row["predicted"] = predicted
    if not points:
        return {"error": "no split loaded"}, rows, points
    try:
        # Every candidate keeps some of the model on every device, so an unmeasured round
        # trip's cost is in every point and is carried by the per-byte times.
        cal = speed.calibrate(labels, build.get("commit") or "", speed.model_key(tensors),
                              points, rtt=rtt)
    except ValueError as exc:
        return {"error": str(exc)}, rows, points
    kept = [{k: r[k] for k in ("ts", "layers", "measured", "predicted")} for r in loaded]
    return {**cal.to_json(), "splits": kept}, rows, points


def _alone(conn, sudo: bool, cluster, server, key, argv: list[str], runs: int,
           progress) -> dict:
    """The model on the orchestrator alone, as bench --compare-local runs it, while the
    deployed server is stopped: {"gen", "prompt"} tokens/s, or {"skipped": why}."""
    try:
        result = server_api.compare_local(conn, sudo, cluster, server, key, runs,
                                          server_api.N_PREDICT, progress, argv=argv)
    except Exception as exc:  # HTTP, SSH channel and socket failures come in many classes
        return {"skipped": f"{exc} (see `journalctl -u "
                           f"{server_api.LOCAL_UNIT.format(name=server.name)}`)"}
    if "skipped" in result:
        return {"skipped": result["skipped"]}
    return {m: result["overall"][k]["median"] for m, k in (("gen", "tg"), ("prompt", "pp"))}


def sweep_server(cluster, server, settings, runs: int, count: int, local: bool,
                 progress, seconds: int = sweep_guard.SECONDS) -> dict:
    from meshdeploy.engine import speeds

    conn = server_api.connect(settings)
    try:
        # The key file, the process's argv and systemd need root.
        sudo = settings.sudo if settings.local else settings.user != "root"
        key = server_api.read_key(conn, server, sudo)
        deployed = server_api.Api(conn, local_address(server.bind), server.port, key,
                                  unit=server.unit_name, sudo=sudo)
        deployed.wait_healthy(0)
        build = server_api.build_of(conn, deployed, cluster.prefix)
        argv = server_api.planned_argv(conn, cluster, server)
        files = server_api.model_files(argv)
        labels = [label for label, *_ in cluster.server_devices(server)]
        params = {"runs": runs, "points": count, "n_predict": server_api.N_PREDICT}
        result = {"server": server.name, "host": server.host, "model": server.model,
                  "build": build, "devices": labels, "params": params}
        if len(files) > 1:
            return {**result, "skipped": f"{files[0]} is a split GGUF; the sweep reads the "
                                         "layers from a one-file model's header only"}
        shape, tensors = read_model(conn, files[0])
        splits = candidates(shape["n_layers"], labels, count, gpu_layers(argv))
        if len(splits) < len(labels) + 1:
            return {**result, "skipped": f"{shape['n_layers']} layers give only {len(splits)} "
                                         f"distinct splits over {len(labels)} devices; "
                                         f"{len(labels) + 1} are needed"}
        rtt: list = []
        alone: dict = {}

        def first():
            progress("timing an RPC round trip to each worker")
            rtt.extend(round_trips(conn, cluster, server))

        def last():
            alone.update(_alone(conn, sudo, cluster, server, key, argv, runs, progress))

        measured = _sweep(conn, sudo, cluster, server, key, argv, splits, runs, progress, first,
                          last if local else None, seconds)
        entry, rows, _ = _fit(labels, build, tensors, shape, splits, measured, tuple(rtt))
        result.update(time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      splits=rows, alone=alone)
        if "error" in entry:
            return {**result, "fit_error": entry["error"]}
        entry["measured_at"] = result["time"]
        if "gen" in alone:
            entry["alone"] = {k: alone[k] for k in ("gen", "prompt")}
        result["calibration"] = {k: v for k, v in entry.items() if k != "splits"}
        result["kept"] = str(speeds.write(cluster.path, server.name, entry))
        return result
    finally:
        conn.close()


def hosts_of(cluster, servers) -> list[str]:
    """The hosts a sweep of `servers` uses: their orchestrators and their workers."""
    names = {s.host for s in servers}
    for server in servers:
        names.update(e.host.name for e in cluster.rpc_endpoints(server))
    return sorted(names)


def skip(cluster, server) -> str | None:
    """Why `server` cannot be swept without connecting, or None."""
    host = cluster.host(server.host)
    if host.rootless:
        return (f"{host.name} is rootless: the sweep runs its splits as transient system units, "
                "which need root")
    n = len(cluster.server_devices(server))
    if n < 2:
        return f"it has {n} device{'s' if n != 1 else ''}: there is no split to measure"
    return None
