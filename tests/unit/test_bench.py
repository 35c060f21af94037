"""meshdeploy bench without hosts: statistics over llama-server timings, the views, the kept
result and its change, the local copy's argv and the "does it fit" check. The measuring itself
runs against real hosts in tests/lab/test_bench_lab.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshdeploy.engine import server_api
from meshdeploy.views import bench as report

REPO = Path(__file__).resolve().parents[2]


def timings(prompt_n, prompt_ms, predicted_n, predicted_ms):
    """Shaped as llama-server's /completion `timings`."""
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_second": prompt_n * 1000 / prompt_ms,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_second": predicted_n * 1000 / predicted_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n}


RUNS = [[timings(10, 100, 64, 1000), timings(500, 1000, 64, 1600)],
        [timings(10, 50, 64, 800), timings(500, 1250, 64, 2000)],
        [timings(10, 200, 64, 1280), timings(500, 2000, 64, 1000)]]


def result(pp_scale=1.0, tg_scale=1.0, name="main"):
    runs = [[dict(t, prompt_ms=t["prompt_ms"] / pp_scale, predicted_ms=t["predicted_ms"] / tg_scale)
             for t in run] for run in RUNS]
    return {"server": name, "host": "node1", "model": "gemma", "time": "2026-01-01T00:00:00+00:00",
            "build": {"commit": "f" * 40, "info": "b11312-fffffff"},
            "params": {"runs": 3, "warmup": 1, "n_predict": 64, "seed": 42, "temperature": 0,
                       "cache_prompt": False},
            **server_api.summarize(runs, ["short", "long"])}


def test_summarize_gives_min_median_max_of_each_prompt():
    s = server_api.summarize(RUNS, ["short", "long"])
    short, long = s["prompts"]
    assert short["prompt"] == "short" and short["prompt_n"] == 10 and short["predicted_n"] == 64
    assert short["pp"] == {"min": 50.0, "median": 100.0, "max": 200.0}
    assert long["pp"] == {"min": 250.0, "median": 400.0, "max": 500.0}
    assert short["tg"] == {"min": 50.0, "median": 64.0, "max": 80.0}
    assert long["tg"] == {"min": 32.0, "median": 40.0, "max": 64.0}


def test_overall_is_each_runs_tokens_over_its_time():
    s = server_api.summarize(RUNS, ["short", "long"])
    # pp per run: 510/1.1 s, 510/1.3 s, 510/2.2 s
    assert s["overall"]["pp"] == {"min": 231.82, "median": 392.31, "max": 463.64}
    assert s["overall"]["prompt_n"] == 510 and s["overall"]["predicted_n"] == 128
    assert s["samples"][1][0]["prompt_ms"] == 50 and "prompt_per_token_ms" not in s["samples"][1][0]


def test_a_rate_of_zero_time_is_zero_not_an_error():
    assert server_api.rate(5, 0) == 0.0
    with pytest.raises(ValueError):
        server_api.spread([])


def test_ratio_and_change_against_the_kept_result():
    now, before = result(pp_scale=1.1, tg_scale=0.5), result()
    assert report.ratio(now["overall"], before["overall"]) == {"pp": 1.1, "tg": 0.5}
    ch = report.change(now, report.kept(before))
    assert ch["overall"] == {"pp": 1.1, "tg": 0.5}
    assert ch["prompts"]["long"] == {"pp": 1.1, "tg": 0.5}
    assert ch["build"]["commit"] == "f" * 40 and ch["since"] == before["time"]
    assert report.change(now, None) is None
    assert report.change(now, {"overall": {"pp": 3}}) is None  # another shape: no comparison
    zero = result()
    zero["overall"]["pp"]["median"] = 0
    assert report.ratio(now["overall"], zero["overall"])["pp"] is None


def test_state_is_written_atomically_and_keeps_other_servers(tmp_path):
    cluster = tmp_path / "prod.yaml"
    assert report.read_state(cluster) == {}
    path = report.write_state(cluster, [result(name="a"), result(name="b")])
    assert path == tmp_path / "prod.bench.json"
    report.write_state(cluster, [result(pp_scale=2, name="a")])
    state = report.read_state(cluster)
    assert set(state) == {"a", "b"}
    assert state["a"]["overall"]["pp"]["median"] == 2 * state["b"]["overall"]["pp"]["median"]
    assert "samples" not in state["a"]
    assert [p.name for p in tmp_path.iterdir()] == ["prod.bench.json"]  # no .tmp left


@pytest.mark.parametrize("content", ["not json", "[]", '{"format_version": 99, "servers": {}}',
                                     '{"format_version": 1, "servers": []}'])
def test_an_unreadable_or_foreign_state_counts_as_none(tmp_path, content):
    (tmp_path / "c.bench.json").write_text(content)
    assert report.read_state(tmp_path / "c.yaml") == {}


def test_text_view_shows_the_tables_the_local_ratio_and_the_change():
    r = result()
    r["local"] = {**server_api.summarize(RUNS, ["short", "long"]), "port": 40001,
                  "fits": "model 0.24 GiB + 512 MiB margin, 20.00 GiB available"}
    r["ratio_to_local"] = {"pp": 0.97, "tg": 0.5}
    r["change"] = report.change(result(tg_scale=2), report.kept(result()))
    text = report.render_text([r])
    assert "llama-server main on node1: model gemma, build b11312-fffffff (commit ffffffffffff)" \
        in text
    assert "3 runs after 1 warm-up, 64 tokens generated per prompt" in text
    assert "short     10           64            50.0 / 100.0 / 200.0" in text
    assert "all       510          128           231.8 / 392.3 / 463.6" in text
    assert "alone (port 40001, model 0.24 GiB" in text
    assert "cluster / local: pp 0.97x, tg 0.50x" in text
    assert "Change since the last bench (2026-01-01T00:00:00+00:00" in text
    assert text.rstrip().endswith("pp 1.00x, tg 2.00x")


def test_text_view_says_when_there_is_nothing_to_compare_with():
    r = result()
    r["change"] = None
    r["local"] = {"skipped": "the model does not fit"}
    text = report.render_text([r])
    assert "No earlier bench of this server to compare with." in text
    assert "Local comparison skipped: the model does not fit" in text


def test_text_view_makes_what_the_server_and_the_bench_file_say_inert(tmp_path):
    """The build's text comes from the server's /props, the earlier result from the bench file
    (whoever can write the cluster file's folder writes it): neither reaches the terminal as a
    control sequence, and an earlier build of the wrong shape is no internal error."""
    cluster = tmp_path / "c.yaml"
    earlier = {**report.kept(result()), "model": "gemma\x1b]52;c;ZWNobyBoaQ==\x07",
               "time": "2026\x9b31m", "build": ["not", "a", "dict"]}
    (tmp_path / "c.bench.json").write_text(json.dumps(
        {"format_version": report.FORMAT_VERSION, "servers": {"main": earlier}}))
    r = result()
    r["build"] = {"commit": "f" * 40, "info": "b1\x1b[2J"}
    r["change"] = report.change(r, report.read_state(cluster)["main"])
    text = report.render_text([r])
    assert not any(c in text for c in "\x1b\x07\x9b"), text
    assert "b1\\x1b[2J" in text and "gemma\\x1b]52;c;ZWNobyBoaQ==\\x07" in text
    assert "2026\\x9b31m, build unknown" in text


def test_json_view_is_versioned_and_carries_the_same_figures():
    r = result()
    data = json.loads(report.render_json("lab", [r], "/x/lab.bench.json"))
    assert data["format_version"] == report.FORMAT_VERSION and data["cluster"] == "lab"
    assert data["servers"][0]["overall"] == r["overall"]
    assert data["state_file"] == "/x/lab.bench.json"


RUNNING = ["/opt/meshdeploy/builds/k/bin/llama-server", "-m", "/opt/m/g.gguf",
           "--host", "10.0.0.1", "--port", "8080", "--rpc", "10.0.0.2:50052,10.0.0.3:50052",
           "-ngl", "99", "-ts", "1,1", "-c", "2048",
           "--api-key-file", "/run/credentials/meshdeploy-server-main.service/api-key",
           "-lm", "none", "--threads", "4"]


def test_local_argv_drops_the_workers_and_moves_to_a_loopback_port():
    argv = server_api.local_argv(RUNNING, 40001,
                                 "/run/credentials/meshdeploy-bench-main.service/api-key")
    assert argv == ["/opt/meshdeploy/builds/k/bin/llama-server", "-m", "/opt/m/g.gguf",
                    "--host", "127.0.0.1", "--port", "40001", "-ngl", "99", "-c", "2048",
                    "--api-key-file", "/run/credentials/meshdeploy-bench-main.service/api-key",
                    "-lm", "none", "--threads", "4"]


def test_local_argv_without_a_key_and_with_equals_forms():
    argv = server_api.local_argv([RUNNING[0], "-m", "x.gguf", "--rpc=h:1", "--tensor-split=1,2",
                             "--api-key-file", "/k", "-c", "0"], 5, None)
    assert argv == [RUNNING[0], "-m", "x.gguf", "-c", "0", "--host", "127.0.0.1", "--port", "5"]


def test_model_files_lists_every_part_of_a_split_gguf():
    assert server_api.model_files(RUNNING) == ["/opt/m/g.gguf"]
    assert server_api.model_files(["s", "--model", "/m/q-00001-of-00003.gguf"]) == [
        "/m/q-00001-of-00003.gguf", "/m/q-00002-of-00003.gguf", "/m/q-00003-of-00003.gguf"]
    with pytest.raises(server_api.BenchError):
        server_api.model_files(["s", "--port", "1"])


def test_fits_compares_model_and_margin_with_available_memory():
    gib = 1 << 30
    ok, why = server_api.fits(4 * gib, 8 * gib)
    assert ok and why == "model 4.00 GiB + 512 MiB margin, 8.00 GiB available"
    assert not server_api.fits(4 * gib, 4 * gib + (256 << 20))[0]
    assert server_api.fits(4 * gib, 4 * gib + server_api.LOCAL_MARGIN)[0]


def test_requests_are_deterministic_and_skip_the_prompt_cache():
    body = server_api.request_body("hi", 64)
    assert body["temperature"] == 0 and body["seed"] == server_api.SEED
    assert body["cache_prompt"] is False and body["ignore_eos"] is True and body["n_predict"] == 64
    assert len({len(text) for _, text in server_api.PROMPTS}) == len(server_api.PROMPTS)


def meshdeploy(*args):
    return subprocess.run([sys.executable, "-m", "meshdeploy", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


def test_an_unknown_server_is_one_clear_error():
    proc = meshdeploy("bench", "inventories/lab.yaml", "--server", "nope")
    assert proc.returncode == 1
    assert proc.stderr.startswith("--server 'nope' is not a server of inventories/lab.yaml")
    assert "servers in the file: main" in proc.stderr and "Traceback" not in proc.stderr


def test_runs_below_one_is_refused():
    proc = meshdeploy("bench", "inventories/lab.yaml", "--runs", "0")
    assert proc.returncode == 1 and "--runs must be at least 1" in proc.stderr
