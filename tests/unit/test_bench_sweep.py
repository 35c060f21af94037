"""meshdeploy bench --sweep without hosts: the candidate splits, the -ts rewrite of the running
argv, the held-out predictions, the order of stops and starts around the sweep, the views and
the refusals before anything is stopped. The sweep itself runs against real hosts in
tests/lab/test_bench_lab.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshdeploy.config.model import Health
from meshdeploy.engine import server_api, sweep
from meshdeploy.placement import speed
from meshdeploy.views import sweep as view

REPO = Path(__file__).resolve().parents[2]
MB = 10 ** 6


def shape(n_layers: int, layer: int = 10 * MB, output: int = 30 * MB) -> dict:
    """The fields of tensors.model_shape() that placement and held_bytes read."""
    return {"n_layers": n_layers, "layer_bytes": [layer] * n_layers,
            "output_device_bytes": output}


@pytest.mark.parametrize("n_layers,devices", [(18, 2), (48, 3), (26, 6), (80, 4)])
def test_candidates_differ_in_placement_and_can_be_fitted(n_layers, devices):
    labels = [f"node{i}:50052/CPU" for i in range(devices)]
    splits = sweep.candidates(n_layers, labels, sweep.POINTS)
    assert len(splits) == sweep.POINTS
    placements = [(p.layer_device, p.output_device) for _, p in splits]
    assert len(set(placements)) == len(placements)
    for ts, p in splits:
        assert sum(ts) == n_layers + 1  # the output layer's slot included
        assert all(p.layers_of(d) or p.output_device == d for d in range(devices))
    assert splits[0][0] == sweep.apportion(n_layers + 1, [1.0] * devices)  # the even split
    # Every device's per-byte time can be told apart: the fit's rank check passes, and a
    # model of known speeds is found again from the splits' bytes.
    truth = speed.Fit(tuple(1e-9 * (d + 1) for d in range(devices)))
    points = [speed.Point(b, truth.seconds(b)) for b in
              (speed.held_bytes(p, shape(n_layers)) for _, p in splits)]
    assert speed.fit(points).per_byte == pytest.approx(truth.per_byte, rel=1e-6)


def test_candidates_stop_at_the_distinct_placements_there_are():
    splits = sweep.candidates(3, ["a", "b"], 7)
    assert [ts for ts, _ in splits] == [[2, 2], [3, 1], [1, 3]]
    # One more split than devices is what the held-out predictions need: here there are.
    assert len(sweep.candidates(2, ["a", "b", "c"], 7)) == 1


def test_apportion_keeps_a_slot_per_device_while_there_are_enough():
    assert sweep.apportion(19, [18.0, 1.0]) == [18, 1]
    assert sweep.apportion(19, [19.0, 0.0]) == [18, 1]
    assert sweep.apportion(2, [1.0, 1.0, 1.0]) in ([1, 1, 0], [1, 0, 1], [0, 1, 1])
    assert sum(sweep.apportion(26, [5, 1, 1, 1, 1, 1])) == 26


RUNNING = ["/opt/meshdeploy/builds/k/bin/llama-server", "-m", "/opt/m/g.gguf",
           "--host", "10.0.0.1", "--port", "8080", "--rpc", "10.0.0.2:50052,10.0.0.3:50052",
           "-ngl", "99", "-ts", "1,1", "-c", "2048",
           "--api-key-file", "/run/credentials/meshdeploy-server-main.service/api-key"]


def test_the_split_replaces_ts_in_every_spelling():
    assert sweep.with_split(RUNNING, [12, 7])[RUNNING.index("-ts"):][:2] == ["-ts", "12,7"]
    long = ["s", "--tensor-split", "1,1", "-c", "0"]
    assert sweep.with_split(long, [3, 4]) == ["s", "--tensor-split", "3,4", "-c", "0"]
    assert sweep.with_split(["s", "--tensor-split=1,1", "-c", "0"], [3, 4]) == \
        ["s", "--tensor-split=3,4", "-c", "0"]
    assert sweep.with_split(["s", "-c", "0"], [5, 1]) == ["s", "-c", "0", "-ts", "5,1"]


def test_a_sweep_copy_keeps_the_workers_on_a_loopback_port():
    argv = sweep.with_split(server_api.local_argv(RUNNING, 40001, "/run/k", drop=frozenset()),
                            [10, 9])
    assert argv == [RUNNING[0], "-m", "/opt/m/g.gguf", "--host", "127.0.0.1", "--port", "40001",
                    "--rpc", "10.0.0.2:50052,10.0.0.3:50052", "-ngl", "99", "-ts", "10,9",
                    "-c", "2048", "--api-key-file", "/run/k"]


@pytest.mark.parametrize("argv,expected", [
    (RUNNING, 99), (["s", "--n-gpu-layers=12"], 12), (["s", "-ngl", "-1"], None),
    (["s", "--gpu-layers", "all"], None), (["s"], None)])
def test_gpu_layers_as_placement_reads_them(argv, expected):
    assert sweep.gpu_layers(argv) == expected


def points_of(per_byte, held, noise=()):
    truth = speed.Fit(per_byte)
    return [speed.Point(b, truth.seconds(b) * (1 + (noise[i] if i < len(noise) else 0)),
                        truth.seconds(b) / 20) for i, b in enumerate(held)]


HELD = [(100 * MB, 100 * MB), (150 * MB, 50 * MB), (50 * MB, 150 * MB), (180 * MB, 20 * MB)]


def test_held_out_predictions_match_a_noise_free_model():
    points = points_of((2e-10, 5e-10), HELD)
    for point, predicted in zip(points, sweep.held_out(["a", "b"], points)):
        assert predicted["gen"] == pytest.approx(1 / point.gen, rel=1e-6)
        assert predicted["prompt"] == pytest.approx(1 / point.prompt, rel=1e-6)


def test_a_held_out_prediction_never_sees_its_own_point():
    points = points_of((2e-10, 5e-10), HELD, noise=(0, 0, 0, 0.5))
    predicted = sweep.held_out(["a", "b"], points)
    # The noisy point is predicted from the three exact ones: the true speed, not its own.
    assert predicted[3]["gen"] == pytest.approx(1 / speed.Fit((2e-10, 5e-10)).seconds(HELD[3]),
                                                rel=1e-6)
    assert predicted[3]["gen"] > 1.4 / points[3].gen
    # With the noisy point among the others, the rest are off, as a fit on all would not be.
    assert predicted[0]["gen"] != pytest.approx(1 / points[0].gen, rel=1e-3)


def test_held_out_is_none_where_the_other_points_cannot_be_fitted():
    points = points_of((2e-10, 5e-10), HELD[:2])
    assert sweep.held_out(["a", "b"], points) == [{"gen": None, "prompt": None}] * 2


def summary(gen: float, prompt: float) -> dict:
    """The part of bench's summary (engine.server_api.summarize) the sweep reads."""
    return {"overall": {"tg": {"median": gen}, "pp": {"median": prompt}}}


def fitted(measured, labels=("node2:50052/CPU", "node3:50052/CPU"), n_layers=18):
    splits = sweep.candidates(n_layers, list(labels), len(measured))
    tensors = [speed_tensor(f"blk.{i}.w", i) for i in range(n_layers)]
    return sweep._fit(list(labels), {"commit": "c" * 40}, tensors, shape(n_layers), splits,
                      measured)


def speed_tensor(name, i):
    from meshdeploy.placement.tensors import Tensor

    return Tensor(name, 1000 + i * 10 * MB, 10 * MB, i)


MEASURED = [summary(50.0, 900.0), summary(47.0, 850.0), {"error": "exited before healthy"},
            summary(40.0, 700.0), summary(55.0, 950.0)]


def test_the_kept_entry_holds_the_fit_and_every_loaded_split():
    entry, rows, points = fitted(MEASURED)
    assert len(points) == 4 and entry["points"] == 4
    assert entry["devices"] == ["node2:50052/CPU", "node3:50052/CPU"]
    assert entry["commit"] == "c" * 40 and len(entry["model"]) == 16
    assert all(v >= 0 for v in entry["gen"]) and len(entry["prompt"]) == 2
    assert [s["ts"] for s in entry["splits"]] == [r["ts"] for r in rows if r["loaded"]]
    assert entry["splits"][0]["measured"] == {"gen": 50.0, "prompt": 900.0}
    assert all(s["predicted"]["gen"] > 0 for s in entry["splits"])
    assert rows[2] == {**rows[2], "loaded": False, "error": "exited before healthy"}
    assert speed.Calibration.from_json(entry).points == 4
    # "error" marks a fit that failed (sweep_server): a kept entry never has that key.
    assert "error" not in entry and entry["held_out_error"] >= 0


def test_too_few_loaded_splits_keep_nothing_and_say_why():
    entry, rows, _ = fitted([summary(50.0, 900.0), {"error": "x"}, {"error": "y"}])
    assert entry == {"error": "1 splits measured for 2 devices: at least 2 are needed"}
    assert [r["loaded"] for r in rows] == [True, False, False]


class FakeCopy:
    def __init__(self, log, fail_on=None):
        self.log, self.fail_on, self.unit, self.key_path = log, fail_on, "meshdeploy-sweep-m", None

    def refusal(self, argv):
        return None

    def start(self, argv):
        self.log.append(("start copy", argv[argv.index("-ts") + 1]))
        if self.fail_on == argv[argv.index("-ts") + 1]:
            raise server_api.BenchError("llama-server on 127.0.0.1:1 exited before it was healthy")

    def active(self):
        return True

    def stop(self):
        self.log.append(("stop copy",))

    def api(self, port, key):
        return FakeApi(None, "127.0.0.1", port, key)


class FakeApi:
    def __init__(self, conn, address, port, key, **_):
        self.port = port

    def wait_healthy(self, seconds, alive=None):
        self.log.append(("healthy", self.port))


class Server:
    name, host, unit_name, bind, port = "m", "node1", "meshdeploy-server-m", "127.0.0.1", 8080
    health = Health(1, 1.0)


def remote(log, deployed="inactive"):
    """run_remote's stand-in: the dead-man timer's commands logged as ("arm", timer) and
    ("cancel", timers), the deployed unit's state answered with `deployed`, others logged."""
    def run(conn, command, sudo=False):
        if "--on-active" in command:
            log.append(("arm", command.split("NAME=", 1)[1].split("\n", 1)[0]))
        elif "reset-failed" in command and ".timer" in command:
            log.append(("cancel", command.split("set -- ", 1)[1].split("\n", 1)[0]))
        elif command.startswith("systemctl is-active meshdeploy-server-m"):
            return deployed + "\n"
        else:
            log.append(("run", command))
        return ""
    return run


@pytest.fixture
def fakes(monkeypatch):
    log = []
    FakeApi.log = log
    monkeypatch.setattr(server_api, "Api", FakeApi)
    monkeypatch.setattr(server_api, "free_port", lambda conn: 40001)
    monkeypatch.setattr(server_api, "run_remote", remote(log))
    return log


BOTH = "meshdeploy-sweep-restart-m-0 meshdeploy-sweep-restart-m-1"


def test_the_deployed_server_is_stopped_for_the_sweep_and_started_again(fakes, monkeypatch):
    measures = iter([summary(50.0, 900.0), summary(45.0, 800.0)])
    monkeypatch.setattr(server_api, "measure", lambda api, runs, n, progress: next(measures))
    monkeypatch.setattr(server_api, "Copy", lambda *a: FakeCopy(fakes, fail_on="12,7"))
    splits = sweep.candidates(18, ["a", "b"], 3)
    measured = sweep._sweep(None, True, None, Server(), None, RUNNING, splits, 1,
                            lambda line: None)
    assert measured[1] == {"error": "llama-server on 127.0.0.1:1 exited before it was healthy "
                                    "(see `journalctl -u meshdeploy-sweep-m`)"}
    assert measured[0]["overall"]["tg"]["median"] == 50.0
    assert measured[2]["overall"]["tg"]["median"] == 45.0
    # A timer left by a killed sweep is cancelled; one is armed before the server stops.
    assert fakes[:3] == [("cancel", BOTH), ("arm", "meshdeploy-sweep-restart-m-0"),
                         ("run", "systemctl stop meshdeploy-server-m")]
    assert [e for e in fakes if e[0] == "start copy"] == [
        ("start copy", "10,9"), ("start copy", "12,7"), ("start copy", "7,12")]
    assert fakes.count(("stop copy",)) == 3  # every copy, the failed one too
    assert fakes[-3:] == [("run", "systemctl start meshdeploy-server-m"), ("cancel", BOTH),
                          ("healthy", 8080)]


def test_an_interrupted_sweep_starts_the_deployed_server_again(fakes, monkeypatch):
    def interrupted(api, runs, n, progress):
        raise KeyboardInterrupt
    monkeypatch.setattr(server_api, "measure", interrupted)
    monkeypatch.setattr(server_api, "Copy", lambda *a: FakeCopy(fakes))
    with pytest.raises(KeyboardInterrupt):
        sweep._sweep(None, True, None, Server(), None, RUNNING,
                     sweep.candidates(18, ["a", "b"], 3), 1, lambda line: None)
    assert fakes[-4:] == [("stop copy",), ("run", "systemctl start meshdeploy-server-m"),
                          ("cancel", BOTH), ("healthy", 8080)]


def result():
    entry, rows, _ = fitted(MEASURED)
    return {"server": "main", "host": "node1", "model": "gemma", "build": {"commit": "c" * 40},
            "devices": ["node2:50052/CPU", "node3:50052/CPU"],
            "params": {"runs": 1, "points": 5, "n_predict": 64}, "time": "2026-11-27T00:00:00",
            "splits": rows, "calibration": {k: v for k, v in entry.items() if k != "splits"},
            "kept": "/x/lab.speed.json"}


def test_text_view_shows_measured_against_held_out_predictions():
    r = result()
    text = view.render_text([r])
    assert text.startswith("llama-server main on node1: model gemma, 4 of 5 splits loaded, "
                           "1 runs each\n")
    header = next(line for line in text.splitlines() if line.startswith("split (-ts)"))
    assert header.split() == ["split", "(-ts)", "layers", "tg", "t/s", "tg", "predicted", "error",
                              "pp", "t/s", "pp", "predicted", "error"]
    first = r["splits"][0]
    row = next(line for line in text.splitlines() if line.startswith("10,9 "))
    assert row.split()[:5] == ["10,9", "10", "/", "8", "50.0"]
    assert row.split()[5] == f"{first['predicted']['gen']:.1f}"
    assert row.split()[6] == view.error(50.0, first["predicted"]["gen"])
    assert "7,12           7 / 11    not measured" in text
    assert "-ts 7,12 not measured: exited before healthy" in text
    assert "Best measured split: -ts 4,15 (node2:50052/CPU: layers 0-3; node3:50052/CPU: " \
           "layers 4-17 + output), tg 55.0 t/s" in text
    gen = r["calibration"]["gen"]
    assert f"node2:50052/CPU  {gen[0] * 1e9:.4g}" in text
    assert text.rstrip().endswith("Kept in /x/lab.speed.json: placement: auto uses it while the "
                                  "devices, the build and the model stay the same.")


def test_view_error_is_percent_of_the_measurement():
    assert view.error(50.0, 55.0) == "+10.0%"
    assert view.error(50.0, 45.0) == "-10.0%"
    assert view.error(50.0, None) == "n/a"


def test_text_view_of_a_skipped_server_and_a_failed_fit():
    r = result()
    del r["calibration"], r["kept"]
    r["fit_error"] = "1 splits measured for 2 devices: at least 2 are needed"
    text = view.render_text([r, {"server": "side", "host": "mac", "skipped": "mac is rootless"}])
    assert "No speeds kept: 1 splits measured for 2 devices" in text
    assert "Kept in" not in text
    assert "llama-server side on mac: skipped, mac is rootless" in text


def test_json_view_is_versioned_and_carries_the_same_figures():
    r = result()
    data = json.loads(view.render_json("lab", [r], "/x/lab.speed.json"))
    assert data["format_version"] == view.FORMAT_VERSION and data["cluster"] == "lab"
    assert data["servers"][0]["splits"] == json.loads(json.dumps(r["splits"]))
    assert data["speed_file"] == "/x/lab.speed.json"


def meshdeploy(*args):
    return subprocess.run([sys.executable, "-m", "meshdeploy", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120, stdin=subprocess.DEVNULL)


def test_without_a_terminal_and_auto_approve_the_sweep_is_refused_before_anything_stops():
    proc = meshdeploy("bench", "inventories/lab.yaml", "--sweep")
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr.startswith("bench --sweep stops llama-server main on node1 for the "
                                  "sweep; starts it again afterwards\n")
    assert "bench --sweep needs confirmation, and stdin is not a terminal" in proc.stderr
    assert "hint: rerun with --auto-approve" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args,message", [
    (["--sweep", "--compare-local"], "--sweep and --compare-local cannot be used together"),
    (["--points", "4"], "--points is an option of --sweep"),
    (["--no-local"], "--no-local is an option of --sweep"),
    (["--sweep", "--points", "2", "--auto-approve"],
     "--points 2 is too few for server main's 2 devices"),
    (["--sweep", "--json"], "bench --sweep --json cannot ask for confirmation"),
])
def test_bad_sweep_options_are_one_clear_error(args, message):
    proc = meshdeploy("bench", "inventories/lab.yaml", *args)
    assert proc.returncode == 1
    if "--json" in args:  # the error is the one JSON document on stdout
        assert proc.stderr == ""
        assert json.loads(proc.stdout)["diagnostics"][0]["summary"] == message
        return
    assert proc.stderr.startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and "stops llama-server" not in proc.stderr


class Cluster:
    """What sweep.skip reads of a cluster: its hosts and each server's devices."""
    def __init__(self, rootless=False, devices=2):
        self.rootless, self.devices = rootless, devices

    def host(self, name):
        return type("Host", (), {"name": name, "rootless": self.rootless})()

    def server_devices(self, server):
        return [(f"w{i}:50052/CPU", None, "CPU", None) for i in range(self.devices)]


def test_servers_that_cannot_be_swept_are_skipped_with_the_reason():
    assert sweep.skip(Cluster(), Server()) is None
    assert sweep.skip(Cluster(rootless=True), Server()) == (
        "node1 is rootless: the sweep runs its splits as transient system units, which need root")
    assert sweep.skip(Cluster(devices=1), Server()) == \
        "it has 1 device: there is no split to measure"
    assert sweep.skip(Cluster(devices=0), Server()) == \
        "it has 0 devices: there is no split to measure"
    notice = view.render_notice([Server()], [{"server": "side", "host": "mac",
                                              "skipped": "it has 0 devices: there is no split "
                                                         "to measure"}])
    assert notice.splitlines() == [
        "bench --sweep stops llama-server m on node1 for the sweep; starts it again afterwards",
        "llama-server side on mac: skipped, it has 0 devices: there is no split to measure"]


class _Conn:
    """Runs the command run_remote gets here, as the orchestrator's shell would."""

    def run(self, command, **_):
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        return type("R", (), {"exited": done.returncode, "stdout": done.stdout,
                              "stderr": done.stderr})()


def test_round_trips_time_a_hello_to_each_worker_on_the_orchestrator(monkeypatch):
    """The round-trip script runs for real against a loopback listener that answers HELLO as
    rpc-server does after `delay` seconds; a worker that does not listen gets 0.0 (not
    measured), a local device 0.0."""
    import socket
    import struct
    import threading
    import time

    from types import SimpleNamespace

    delay = 0.02
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                got = b""
                while len(got) < 33:
                    chunk = conn.recv(64)
                    if not chunk:
                        break
                    got += chunk
                assert got[0] == 14
                time.sleep(delay)
                conn.sendall(struct.pack("<Q", 3) + bytes([3, 6, 0]))

    threading.Thread(target=serve, daemon=True).start()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    # server_devices' rows: (label, host, device, endpoint); endpoint None: a local device.
    devices = [("node2:a/CPU", None, "CPU", SimpleNamespace(target=f"127.0.0.1:{port}")),
               ("node3:b/CPU", None, "CPU", SimpleNamespace(target=f"127.0.0.1:{dead}")),
               ("node1/CPU", None, "CPU", None)]
    cluster = SimpleNamespace(server_devices=lambda server: devices)
    monkeypatch.setattr(sweep, "RTT_ROUNDS", 3)
    try:
        rtt = sweep.round_trips(_Conn(), cluster, None)
    finally:
        listener.close()
    assert delay <= rtt[0] < delay + 0.5
    assert rtt[1:] == (0.0, 0.0)


def test_round_trips_and_the_orchestrator_alone_are_measured_while_the_server_is_stopped(
        fakes, monkeypatch):
    monkeypatch.setattr(server_api, "measure", lambda api, runs, n, progress: summary(50.0, 900.0))
    monkeypatch.setattr(server_api, "Copy", lambda *a: FakeCopy(fakes))
    sweep._sweep(None, True, None, Server(), None, RUNNING, sweep.candidates(18, ["a", "b"], 3),
                 1, lambda line: None, lambda: fakes.append(("first",)),
                 lambda: fakes.append(("last",)))
    order = [e[0] if e[0] != "run" else e[1] for e in fakes]
    stop, start = order.index("systemctl stop meshdeploy-server-m"), \
        order.index("systemctl start meshdeploy-server-m")
    assert stop < order.index("first") < order.index("start copy")
    assert max(i for i, e in enumerate(order) if e == "stop copy") < order.index("last") < start


def test_the_sweep_view_says_what_the_orchestrator_alone_gave():
    r = result()
    r["alone"] = {"gen": 61.0, "prompt": 950.0}
    assert "On node1 alone, without workers: tg 61.0 t/s, pp 950.0 t/s" in view.render_text([r])
    r["alone"] = {"skipped": "the model does not fit beside what runs on the host"}
    assert "On node1 alone: not measured (the model does not fit" in view.render_text([r])
