"""flux_jax.tune and the tuning tables impl="auto" follows (docs/tuning.md).

On CPU the tool runs with --allow-cpu (the CPU backend against the twin: the timings mean
nothing, the mechanics are real); impl="auto" follows a CPU table given as Config(tuning=path).
"""

import contextlib
import functools
import importlib.resources
import io
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax
import flux_jax.tune
from flux_jax import _auto_rule, _plan, _tuning
from flux_jax.tune import _table

from helpers import assert_matches, cpu_mesh, place, random_array, to64

SHAPES = "ag_matmul:64x32x64,matmul_rs:64x64x32"
# Three rounds: a median of one CPU sample under load can read <= 0 (the shape is then unresolved)
FAST = ["--allow-cpu", "--repeats", "3", "--target-ms", "5"]


def _tool(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = flux_jax.tune.main(list(argv))
        except SystemExit as exit_:
            rc = exit_.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One run of the tool on 8 CPU devices: the table's path and the run's output."""
    path = tmp_path_factory.mktemp("tune") / "table.json"
    rc, out, err = _tool("--shapes", SHAPES, "--tp", "8", "--out", str(path), *FAST)
    assert rc == 0, err
    return path, out


def _auto_fn(op, mesh, impl="auto"):
    if op == "ag_matmul":
        specs, body = (P("tp", None), P(None, "tp")), flux_jax.ag_matmul
        out_spec = P(None, "tp")
    else:
        specs, body = (P(None, "tp"), P("tp", None)), flux_jax.matmul_rs
        out_spec = P("tp", None)
    fn = jax.shard_map(
        functools.partial(body, axis_name="tp", impl=impl), mesh=mesh, in_specs=specs, out_specs=out_spec
    )
    return jax.jit(fn), specs, fn


def _rewritten(src: pathlib.Path, dst: pathlib.Path, path: str) -> str:
    """A copy of the table at `src` whose every entry chose `path` (a fused one with a speedup
    that agrees: the CPU backend's measured one is slower than the twin)."""
    data = json.loads(src.read_text())
    for entry in data["entries"]:
        entry["path"] = path
        if path != "twin":
            entry["speedup"] = dict(entry["speedup"], **{path: 1.5})
    dst.write_text(json.dumps(data))
    return str(dst)


def test_help_names_every_input_and_the_docs():
    rc, out, _ = _tool("--help")
    assert rc == 0
    for flag in (
        "--model",
        "--shapes",
        "--from",
        "--tp",
        "--dtype",
        "--out",
        "--budget-minutes",
        "--allow-cpu",
        "llama3-8b",
        "docs/tuning.md",
        "XDG_CACHE_HOME",
    ):
        assert flag in out, flag


def test_refuses_cpu_without_allow_cpu_and_tp_1():
    rc, _, err = _tool("--shapes", SHAPES, "--tp", "2")
    assert rc == 2 and "no GPU here" in err and "--allow-cpu" in err, err
    rc, _, err = _tool("--shapes", SHAPES, "--tp", "1", "--allow-cpu")
    assert rc == 2 and "TP=1 has nothing to overlap" in err, err
    rc, _, err = _tool("--shapes", SHAPES, "--tp", "16", "--allow-cpu")
    assert rc == 2 and "needs 16 devices" in err, err
    rc, _, err = _tool("--shapes", "ag_matmul:64x32", "--allow-cpu")
    assert rc == 2 and "op:MxKxN" in err, err
    rc, _, err = _tool("--from", "no_such_module_here:f", "--allow-cpu")
    assert rc == 2 and "no_such_module_here" in err, err
    rc, _, err = _tool("--allow-cpu")
    assert rc == 2 and "say what to measure" in err, err


def test_refuses_bad_options_and_outputs_before_measuring(tmp_path, monkeypatch):
    for value in ("nan", "inf", "0", "-5"):
        rc, _, err = _tool("--shapes", SHAPES, "--tp", "2", *FAST, "--target-ms", value)
        assert rc == 2 and f"--target-ms must be a positive finite number, got {float(value)}" in err, err
    rc, _, err = _tool("--shapes", SHAPES, "--tp", "2", *FAST, "--repeats", "0")
    assert rc == 2 and "--repeats must be an integer >= 1, got 0" in err, err
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, out, err = _tool("--shapes", SHAPES, "--tp", "2", *FAST, "--out", str(blocker / "table.json"))
    assert rc == 2 and f"cannot write the table {blocker / 'table.json'}" in err, err
    assert "measuring" not in out  # refused before anything ran
    rc, _, err = _tool("--shapes", SHAPES, "--tp", "2", *FAST, "--out", str(tmp_path))
    assert rc == 2 and "is a directory" in err, err

    def full(path, table):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_table, "write", full)
    rc, _, err = _tool("--shapes", SHAPES, "--tp", "2", *FAST, "--out", str(tmp_path / "table.json"))
    assert rc == 2 and "cannot write the table" in err and "No space left on device" in err, err


def test_from_names_a_function_that_takes_no_arguments():
    rc, _, err = _tool("--from", "os:path", "--allow-cpu")
    assert rc == 2 and "--from os:path is a module, not a function that takes no arguments" in err, err
    rc, _, err = _tool("--from", "os.path:join", "--allow-cpu")
    assert rc == 2 and "--from os.path:join cannot be called without arguments" in err, err


def test_a_tp_beyond_the_host_names_the_devices_it_needs():
    from flux_jax.tune import _run

    with pytest.raises(flux_jax.tune.TuneError, match="--tp 2 needs 2 devices; this host has 1"):
        _run._tp_sizes("2", 1)
    with pytest.raises(flux_jax.tune.TuneError, match="TP=1 has nothing to overlap"):
        _run._tp_sizes(None, 1)
    with pytest.raises(flux_jax.tune.TuneError, match="Build its mesh with a TP axis of 2 or more devices"):
        _run._tp_sizes([1], 8, from_function=True)


def test_end_to_end_on_cpu_writes_a_table(measured):
    path, out = measured
    assert "timings do not predict GPU speed" in out
    assert re.search(r"\[#+\] 2/2", out), out  # the progress bar
    assert "auto runs" in out and "ag_matmul  64x32x64" in out  # the summary table
    table = _tuning.load(path)
    assert sorted(e.op for e in table.entries) == ["ag_matmul", "matmul_rs"]
    kind = jax.devices("cpu")[0].device_kind
    assert table.devices[kind].platform == "cpu"
    for entry in table.entries:
        assert (entry.device_kind, entry.gpu_count, entry.tp, entry.dtype) == (kind, 8, 8, "bfloat16")
        assert set(entry.speedup) <= {"overlap", "latency", "decode"}  # paths timed above the noise
        assert entry.path in _tuning.PATHS
    raw = json.loads(path.read_text())
    assert raw["format"] == "flux_jax.tuning" and raw["schema_version"] == _tuning.SCHEMA_VERSION
    assert raw["min_speedup"] == _table.MIN_SPEEDUP == table.min_speedup  # the default, recorded
    for entry in raw["entries"]:
        assert {"ms", "max_rel_err", "shape", "shape_class", "global_shape"} <= set(entry)
        assert {"overlap", "latency"} <= set(entry["max_rel_err"])  # every fused path was checked
        assert all(err <= 2e-2 for err in entry["max_rel_err"].values())


def test_rerun_skips_measured_entries(measured):
    path, _ = measured
    before = path.read_text()
    rc, out, err = _tool("--shapes", SHAPES, "--tp", "8", "--out", str(path), *FAST)
    assert rc == 0, err
    assert out.count("measured before, skipped") == 2, out
    assert "measuring the link" not in out  # the table's device facts are kept
    assert path.read_text() == before


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_auto_follows_a_table_that_prefers_fused_or_the_twin(measured, tmp_path, op):
    path, _ = measured
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)
    fn, (x_spec, w_spec), _ = _auto_fn(op, mesh)
    rng = np.random.default_rng()
    shape_x, shape_w = ((64, 32), (32, 64)) if op == "ag_matmul" else ((64, 64), (64, 32))
    x, w = random_array(rng, shape_x, jnp.bfloat16), random_array(rng, shape_w, jnp.bfloat16)
    xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
    twin = _auto_fn(op, mesh, "xla")[0]
    target = f'custom_call_target="flux_jax_{op}"'  # in the compiled HLO
    # No table: on CPU auto takes the twin.
    assert target not in fn.lower(xs, ws).compile().as_text()
    fused = _rewritten(path, tmp_path / "fused.json", "overlap")
    with flux_jax.config(tuning=fused):
        assert target in fn.lower(xs, ws).compile().as_text()
        out = fn(xs, ws)
        (site,) = flux_jax.explain(_auto_fn(op, mesh)[2], xs, ws)  # a fresh function: explain traces
    assert site.plan.path == "overlap" and site.plan.decided_by == f"tuning table {fused}"
    assert "measured at this shape class" in str(site)
    assert_matches(out, np.tensordot(to64(x), to64(w), axes=1), twin(xs, ws), "bfloat16", f"{op} auto (table)")
    prefers_twin = _rewritten(path, tmp_path / "twin.json", "twin")
    with flux_jax.config(tuning=prefers_twin):
        assert 'custom_call_target="flux_jax_' not in fn.lower(xs, ws).compile().as_text()
        (site,) = flux_jax.explain(_auto_fn(op, mesh)[2], xs, ws)  # a fresh function: explain traces
    assert site.plan.path == "twin" and site.plan.decided_by == f"tuning table {prefers_twin}"
    # impl="fused" under a table that prefers the twin still runs fused: the best fused path measured.
    forced = _auto_fn(op, mesh, "fused")[0]
    with flux_jax.config(tuning=prefers_twin):
        assert 'custom_call_target="flux_jax_' in forced.lower(xs, ws).compile().as_text()


def test_budget_stops_cleanly_and_a_rerun_continues(tmp_path):
    path = tmp_path / "budget.json"
    shapes = "ag_matmul:64x32x64,ag_matmul:512x32x64,matmul_rs:64x64x32"
    argv = (
        "--shapes",
        shapes,
        "--tp",
        "2",
        "--dtype",
        "float32",
        "--budget-minutes",
        "0.0001",
        "--out",
        str(path),
        *FAST,
    )
    rc, out, err = _tool(*argv)
    assert rc == 0, err
    assert "budget of 0.0001 min reached" in out and "re-run the same command" in out, out
    assert out.count("not measured (budget)") == 2, out
    assert len(_tuning.load(path).entries) == 1  # at least one shape per run; the table is valid
    rc, out, err = _tool(*argv)
    assert rc == 0, err
    assert "measured before, skipped" in out and out.count("not measured (budget)") == 1, out
    table = _tuning.load(path)
    assert sorted(e.shape for e in table.entries) == [(64, 32, 32), (512, 32, 32)]


def _cpu_device(**kw):
    kind = jax.devices("cpu")[0].device_kind
    return _tuning.Device(kind, kw.get("platform", "cpu"), 8, 1.0, 1.0)


def _write(tmp_path, entries, device=None, name="table.json", min_speedup=_table.MIN_SPEEDUP):
    device = device or _cpu_device()
    path = tmp_path / name
    _table.write(path, dataclasses_replace(_table.merged(None, device, entries), min_speedup=min_speedup))
    return str(path)


def _entry(rows, path, speedup, device=None, op="ag_matmul", tp=8, gpu_count=8):
    return _table.make_entry(device or _cpu_device(), gpu_count, tp, "bfloat16", op, rows, 64, 64, speedup, path=path)


def _plan_cpu(rows, table, op="ag_matmul", impl="auto"):
    problem = _plan.Problem(op, rows, 64, 64, np.dtype(jnp.bfloat16), 8, "cpu")
    return _plan.plan(problem, impl, flux_jax.Config(tuning=table))


def test_between_measured_points_auto_interpolates_only_where_the_neighbours_agree(tmp_path):
    agree = _write(
        tmp_path,
        [_entry(256, "overlap", {"overlap": 1.3}), _entry(1024, "overlap", {"overlap": 1.2})],
        name="agree.json",
    )
    plan = _plan_cpu(512, agree)
    assert plan.path == "overlap" and "between measured points that agree" in plan.reason
    disagree = _write(
        tmp_path,
        [_entry(256, "overlap", {"overlap": 1.3}), _entry(1024, "twin", {"overlap": 0.9})],
        name="disagree.json",
    )
    plan = _plan_cpu(512, disagree)
    assert plan.path == "twin" and "disagree" in plan.reason, plan
    assert _plan_cpu(512, disagree, impl="fused").path == "overlap"  # impl="fused": the best fused path
    both_beat = _write(
        tmp_path,
        [
            _entry(256, "overlap", {"overlap": 1.3, "latency": 1.1}),
            _entry(1024, "latency", {"overlap": 0.9, "latency": 1.2}),
        ],
        name="both.json",
    )
    plan = _plan_cpu(512, both_beat)
    assert plan.path == "latency" and "beat the twin by the table's --min-speedup 1.02 at both" in plan.reason, plan
    # Far from every measured point the table says nothing: CPU calls keep the CPU default.
    assert _plan_cpu(64 * 1024, agree).decided_by == "platform"
    # Exactly at a measured point its entry decides.
    plan = _plan_cpu(1024, disagree)
    assert plan.path == "twin" and "measured at this shape class" in plan.reason
    # Another TP size, op or dtype is not covered by these entries.
    assert _plan_cpu(512, agree, op="matmul_rs").decided_by == "platform"


def test_gpu_tables_in_order_config_then_user_cache_then_built_in(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kind = "NVIDIA Test GPU"
    monkeypatch.setattr(_tuning._lookup, "local_device", lambda platform: _tuning.LocalDevice(kind, 2, 132))
    device = _tuning.Device(kind, "gpu", 132, 300.0, 10.0)
    problem = _plan.Problem("ag_matmul", 4096, 8192, 4096, np.dtype(jnp.bfloat16), 2, "cuda")

    def plan(config):
        return _plan.plan(problem, "auto", config, on_hopper=True)

    assert plan(flux_jax.Config()).decided_by == _tuning.BUILTIN_SOURCE
    cached = _tuning.cache_path(kind)
    assert cached == tmp_path / "cache" / "flux_jax" / "tuning" / "NVIDIA_Test_GPU.json"
    twin = _table.make_entry(device, 2, 2, "bfloat16", "ag_matmul", 4096, 8192, 4096, {"overlap": 0.95})
    _table.write(cached, _table.merged(None, device, [twin]))
    decided = plan(flux_jax.Config())
    assert decided.path == "twin" and decided.decided_by == f"tuning table {cached}"
    latency = _table.make_entry(device, 2, 2, "bfloat16", "ag_matmul", 4096, 8192, 4096, {"latency": 1.3})
    explicit = _write(tmp_path, [latency], device, "explicit.json")
    decided = plan(flux_jax.Config(tuning=explicit))
    assert decided.path == "latency" and decided.decided_by == f"tuning table {explicit}"
    with flux_jax.config(tuning=explicit):
        assert f"decided by tuning table {explicit}" in flux_jax.explain_auto("ag_matmul", 4096, 8192, 8192, 2)
    # A table of another GPU kind is not this GPU's: the next one decides.
    other = _tuning.Device("Other GPU", "gpu", 132, 300.0, 10.0)
    foreign = _write(
        tmp_path,
        [_table.make_entry(other, 2, 2, "bfloat16", "ag_matmul", 4096, 8192, 4096, {"latency": 1.3})],
        other,
        "foreign.json",
    )
    assert plan(flux_jax.Config(tuning=foreign)).decided_by == f"tuning table {cached}"
    # TP sizes no table has measured take the twin, and say so.
    problem = _plan.Problem("ag_matmul", 4096, 8192, 4096, np.dtype(jnp.bfloat16), 4, "cuda")
    decided = plan(flux_jax.Config())
    assert decided.path == "twin" and "tp=4 has not been measured" in decided.reason


def test_table_errors_are_clear(tmp_path):
    def fails(text, match):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(_tuning.TuningTableError, match=match):
            flux_jax.Config(tuning=str(bad))
        rc, _, err = _tool("--shapes", SHAPES, "--tp", "2", "--out", str(bad), *FAST)
        assert rc == 2 and "tuning table" in err, err  # the tool never overwrites a bad table

    good = json.loads(_tuning.dumps(_tuning.builtin()))
    fails("{not json", "is not JSON")
    fails("[]", "not a flux_jax tuning table")
    fails(json.dumps(dict(good, schema_version=99)), r"schema version 99; this flux_jax reads version 1")
    fails(json.dumps(dict(good, schema_version=True)), r"schema version True; this flux_jax reads version 1")
    fails("[" * 100_000 + "]" * 100_000, "is nested too deeply to be a tuning table")
    kind = next(iter(good["devices"]))
    device = dict(good["devices"][kind], link_latency_us="1.0")
    fails(json.dumps(dict(good, devices={kind: device})), r"field 'link_latency_us' must be a finite number")
    odd_class = dict(good["entries"][0], shape_class={"log2_flop": "x"})
    fails(json.dumps(dict(good, entries=[odd_class])), "field 'log2_flop' must be a number")
    fails(json.dumps(dict(good, entries=[dict(good["entries"][0], path="fastest")])), r"entry 0: field 'path'")
    fails(
        json.dumps(dict(good, entries=[dict(good["entries"][0], device_kind="TPU")])), "is not in the table's devices"
    )
    entry = dict(good["entries"][0], shape_class=dict(good["entries"][0]["shape_class"], log2_flop=1.0))
    fails(json.dumps(dict(good, entries=[entry])), "does not match its shape")
    fails(json.dumps(dict(good, entries=[good["entries"][0]] * 2)), "a second entry")
    kind = next(iter(good["devices"]))
    for field, value in (("link_gbps", 1e-5), ("link_gbps", 10**400), ("link_latency_us", 10**400)):
        device = dict(good["devices"][kind], **{field: value})
        fails(json.dumps(dict(good, devices={kind: device})), rf"device '{kind}': field '{field}' must be a finite")
    for dim in ("rows", "k", "n"):
        entry = dict(good["entries"][0], shape=dict(good["entries"][0]["shape"], **{dim: 10**400}))
        fails(json.dumps(dict(good, entries=[entry])), rf"entry 0: field '{dim}' must be a positive int below 2\*\*63")
    fails(json.dumps(dict(good, entries=[dict(good["entries"][0], speedup={"overlap": 10**400})])), "speedup 'overlap'")
    fails(json.dumps(dict(good, min_speedup=10**400)), "field 'min_speedup'")
    with pytest.raises(_tuning.TuningTableError, match="cannot be read"):
        flux_jax.Config(tuning=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="Config.tuning must be None or the path"):
        flux_jax.Config(tuning=3)
    # Without a shape_class an entry's class is computed from its shape.
    del good["entries"][0]["shape_class"]
    lean = tmp_path / "lean.json"
    lean.write_text(json.dumps(good))
    assert len(_tuning.load(lean).entries) == len(good["entries"])


def test_between_measured_points_a_fused_path_must_beat_the_twin_by_the_tables_margin(tmp_path):
    """Neither neighbour chose overlap; it beat the twin at both by 1.10x: below a 1.2 margin
    (the twin), above a 1.05 one (overlap)."""
    entries = [_entry(256, "twin", {"overlap": 1.10}), _entry(1024, "latency", {"overlap": 1.10, "latency": 1.5})]
    strict = _write(tmp_path, entries, name="strict.json", min_speedup=1.2)
    plan = _plan_cpu(512, strict)
    assert plan.path == "twin" and "disagree" in plan.reason, plan
    loose = _write(tmp_path, entries, name="loose.json", min_speedup=1.05)
    plan = _plan_cpu(512, loose)
    assert plan.path == "overlap" and "by the table's --min-speedup 1.05 at both" in plan.reason, plan


def test_entries_of_this_hosts_gpu_count_are_preferred_not_required(tmp_path):
    """The CPU process has 8 devices: entries measured on 16 answer where no 8-device entry
    does, and 8-device entries answer first where they cover the call."""
    near16 = [
        _entry(256, "latency", {"latency": 1.5}, gpu_count=16),
        _entry(1024, "latency", {"latency": 1.5}, gpu_count=16),
    ]
    far8 = _entry(64 * 1024, "overlap", {"overlap": 1.3}, gpu_count=8)
    plan = _plan_cpu(512, _write(tmp_path, [*near16, far8], name="far8.json"))
    assert plan.path == "latency" and "between measured points that agree" in plan.reason, plan
    near8 = [_entry(384, "overlap", {"overlap": 1.3}), _entry(768, "overlap", {"overlap": 1.3})]
    plan = _plan_cpu(512, _write(tmp_path, [*near16, *near8], name="near8.json"))
    assert plan.path == "overlap", plan


def test_a_tiny_measured_speedup_is_stored_positive_and_reads_back(tmp_path):
    """A noisy twin median far below ours gives a speedup of 3e-05: four decimals made it 0.0,
    which the reader refuses; five significant digits keep it."""
    device = _tuning.Device("cpu", "cpu", 2, 1.0, 10.0)
    entry = _table.make_entry(device, 2, 2, "float32", "ag_matmul", 8, 8, 8, {"overlap": 3.14159e-5})
    assert entry.path == "twin" and entry.speedup == {"overlap": 3.1416e-5}
    path = tmp_path / "table.json"
    _table.write(path, _table.merged(None, device, [entry]))
    assert _tuning.load(path).entries == (entry,)
    broken = _table.merged(None, device, [dataclasses_replace(entry, speedup={"overlap": 0.0})])
    with pytest.raises(_tuning.TuningTableError, match=r"not written: .*speedup 'overlap': 0.0"):
        _table.write(tmp_path / "never.json", broken)
    assert not (tmp_path / "never.json").exists()


def test_a_relative_config_tuning_path_is_resolved_once(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    _write(first, [_entry(256, "overlap", {"overlap": 1.3})])
    monkeypatch.chdir(first)
    cfg = flux_jax.Config(tuning="table.json")
    assert cfg.tuning == str(first / "table.json")
    monkeypatch.chdir(second)  # no table.json here: the Config still names the first one
    assert _plan_cpu(256, cfg.tuning).decided_by == f"tuning table {first / 'table.json'}"


def test_options_the_request_would_ignore_are_refused():
    rc, _, err = _tool("--from", "os.path:join", "--tp", "4", "--dtype", "fp8", "--allow-cpu")
    assert rc == 2 and "--tp, --dtype cannot be used with --from" in err, err
    rc, _, err = _tool("--shapes", SHAPES, "--m", "2048", "--no-sequence-parallel", "--allow-cpu")
    assert rc == 2 and "--m, --no-sequence-parallel cannot be used with --shapes" in err, err


def test_config_tuning_takes_a_path_like(tmp_path):
    table = pathlib.Path(_write(tmp_path, [_entry(256, "overlap", {"overlap": 1.3})]))
    cfg = flux_jax.Config(tuning=table)
    assert cfg.tuning == str(table) and type(cfg.tuning) is str  # hashable, one jit cache key
    assert cfg == flux_jax.Config(tuning=str(table)) and hash(cfg) == hash(flux_jax.Config(tuning=str(table)))
    with flux_jax.config(tuning=table) as inner:
        assert inner.tuning == str(table)
    assert _plan_cpu(256, table).decided_by == f"tuning table {table}"
    for bad in (3, b"table.json", "", [str(table)]):
        with pytest.raises(ValueError, match=r"Config.tuning must be None or the path of a tuning table \(a str or"):
            flux_jax.Config(tuning=bad)


def test_an_entry_whose_path_contradicts_its_speedup_is_refused(tmp_path):
    """A fused path measured slower than the twin beyond the timing's spread is an error where a
    table is loaded, naming the file and the entry; the tool's table code never writes one."""
    good = [_entry(256, "overlap", {"overlap": 1.3}), _entry(1024, "latency", {"latency": 1.1})]
    path = pathlib.Path(_write(tmp_path, good))
    data = json.loads(path.read_text())
    data["entries"][1]["speedup"] = {"latency": 0.9, "overlap": 1.2}
    path.write_text(json.dumps(data))
    message = rf"{re.escape(str(path))}, entry 1: path 'latency' contradicts its speedup 0.9 \(the twin was faster"
    with pytest.raises(_tuning.TuningTableError, match=message):
        _tuning.load(path)
    with pytest.raises(_tuning.TuningTableError, match=message):
        flux_jax.Config(tuning=str(path))
    with pytest.raises(ValueError, match=r"ag_matmul rows=1024 k=64 n=64 .*path 'overlap' contradicts its speedup 0.5"):
        _entry(1024, "overlap", {"overlap": 0.5})
    with pytest.raises(ValueError, match=r"min_speedup must be a number >= 1 .*, got 0.4"):
        _table.choose({"overlap": 0.5}, min_speedup=0.4)
    slower = dataclasses_replace(good[1], speedup={"latency": 0.9})
    with pytest.raises(ValueError, match="contradicts its speedup"):
        _table.write(tmp_path / "never.json", _table.merged(None, _cpu_device(), [slower]))
    assert not (tmp_path / "never.json").exists()


def test_legitimate_path_and_speedup_combinations_load(tmp_path):
    """The twin where fused paths beat it by less than the table's --min-speedup, or by more (a
    choice made elsewhere); a fused path within the timing's spread of the twin or not the fastest
    (a tie settled by other runs); a fused path without a measurement (a hand-settled choice)."""
    entries = [
        _entry(256, "twin", {"overlap": 1.5}),
        _entry(1024, "overlap", {"overlap": 0.99, "latency": 1.1}),
        _entry(4096, "decode", {}),
    ]
    table = _write(tmp_path, entries, min_speedup=2.0)
    assert len(_tuning.load(table).entries) == 3
    plan = _plan_cpu(256, table)
    assert plan.path == "twin", plan
    assert "no fused path beat the twin by the table's --min-speedup 2 (the best, overlap, measured 1.50x)" in (
        plan.reason
    )
    plan = _plan_cpu(256, _write(tmp_path, entries, name="default.json"))
    assert plan.path == "twin", plan
    assert "the twin, although overlap measured 1.50x, not below the table's --min-speedup 1.02 (a choice" in (
        plan.reason
    )
    # The built-in table's float16 entries of decode points take the tool's choice among the
    # paths float16 has: at this point latency measured 0.94x, so the twin.
    assert _auto_rule.choose("ag_matmul", 2, 96, 3072, 8192, np.dtype(np.float16)) == "xla"
    assert _auto_rule.choose("ag_matmul", 2, 96, 3072, 4608, np.dtype(np.float16)) == "latency"  # 1.05x


def test_a_table_records_the_min_speedup_it_was_made_with(tmp_path):
    """The tool writes its --min-speedup into the table; a re-run adds to the table only with the
    same one (the default: the table's own), since the entries chose their paths by it."""
    path = tmp_path / "margin.json"
    argv = ("--shapes", "ag_matmul:64x32x64", "--tp", "2", "--dtype", "float32", "--out", str(path), *FAST)
    rc, _, err = _tool(*argv, "--min-speedup", "1.5")
    assert rc == 0, err
    assert json.loads(path.read_text())["min_speedup"] == 1.5
    table = _tuning.load(path)
    assert table.min_speedup == 1.5 and len(table.entries) == 1
    (entry,) = table.entries
    assert entry.path == _table.choose(entry.speedup, 1.5), entry
    before = path.read_text()
    rc, out, err = _tool(*argv)  # no --min-speedup: the table's
    assert rc == 0 and "measured before, skipped" in out, err
    assert path.read_text() == before
    rc, _, err = _tool(*argv, "--min-speedup", "1.02")
    assert rc == 2 and path.read_text() == before
    assert f"--min-speedup 1.02 differs from the 1.5 that the table {path} was made with" in err, err
    for bad in ("0.5", "inf", "nan"):
        rc, _, err = _tool(*argv, "--min-speedup", bad)
        assert rc == 2 and "--min-speedup must be a number >= 1 (auto never runs a slower path) and finite" in err


def test_min_speedup_of_a_table_is_checked_and_optional(tmp_path):
    """A table made before the field was recorded (the built-in table's former text) loads with
    the tool's default; a recorded one must be what the tool accepts."""
    good = json.loads(_tuning.dumps(_tuning.builtin()))
    assert good["min_speedup"] == _table.MIN_SPEEDUP
    del good["min_speedup"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(good))
    table = _tuning.load(older)
    assert table.min_speedup == _table.MIN_SPEEDUP and table.entries == _tuning.builtin().entries
    for bad in (0.5, "1.02", True, None, float("nan"), float("inf")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(dict(good, min_speedup=bad)))
        message = (
            rf"{re.escape(str(path))}: field 'min_speedup' \(the --min-speedup the table was made with\) must be a "
            rf"number >= 1 \(auto never runs a slower path\) and finite, got {re.escape(repr(bad))}"
        )
        with pytest.raises(_tuning.TuningTableError, match=message):
            _tuning.load(path)
        with pytest.raises(_tuning.TuningTableError, match=message):
            flux_jax.Config(tuning=str(path))
    path.write_text(json.dumps(dict(good, min_speedup=1)))
    assert _tuning.load(path).min_speedup == 1.0
    unwritable = dataclasses_replace(_tuning.load(older), min_speedup=0.5)
    with pytest.raises(_tuning.TuningTableError, match=r"not written: .*'min_speedup'.* must be a number >= 1"):
        _table.write(tmp_path / "never.json", unwritable)
    assert not (tmp_path / "never.json").exists()


def test_only_the_planner_calls_the_table_lookup():
    package = pathlib.Path(flux_jax.__file__).parent
    callers = {
        str(f.relative_to(package)) for f in package.rglob("*.py") if re.search(r"(?<!def )\blookup\(", f.read_text())
    }
    assert callers == {"_plan.py"}, callers


def test_built_in_table_is_the_rule_points_written_by_the_tool():
    shipped = importlib.resources.files("flux_jax._tuning").joinpath("h200_tp2.json")
    assert shipped.is_file()  # package data (pyproject's wheel.packages ships flux_jax/ whole)
    device, entries = _auto_rule.entries()
    assert shipped.read_text() == _tuning.dumps(_table.merged(None, device, entries)), (
        "flux_jax/_tuning/h200_tp2.json is stale: python -m flux_jax._auto_rule rewrites it"
    )
    table = _tuning.builtin()
    assert table.builtin and {e.dtype for e in table.entries} == {"bfloat16", "float16"}
    assert not any(e.path == "decode" for e in table.entries if e.dtype == "float16")
    # Every listed point keeps the rule's choice when the planner reads the table.
    for op, rows, k, n, path, _, _ in _auto_rule.POINTS:
        assert _auto_rule.choose(op, 2, rows, k, n, jnp.bfloat16) == ("xla" if path == "twin" else path), (
            op,
            rows,
            k,
            n,
        )
    problem = _plan.Problem("ag_matmul", 4096, 8192, 4096, np.dtype(jnp.bfloat16), 2, "cuda")
    assert _plan.plan(problem, "auto", flux_jax.Config(), on_hopper=True).decided_by == _tuning.BUILTIN_SOURCE


def test_shape_class_follows_waves_on_the_gpu_sm_count():
    h200 = _tuning.Device("NVIDIA H200", "gpu", 132, 226.9, 19.7)
    fits = _tuning.shape_class("ag_matmul", 192, 4096, 3200, "bfloat16", 2, h200)
    overflows = _tuning.shape_class("ag_matmul", 192, 4096, 3208, "bfloat16", 2, h200)
    assert (fits.decode_waves, overflows.decode_waves) == (1.0, 1.125)  # 100 + 32 CTAs vs 102 + 32 on 132 SMs
    fewer_sms = _tuning.shape_class("ag_matmul", 192, 4096, 3200, "bfloat16", 2, h200, sms=114)
    assert fewer_sms.decode_waves > 1.0 and fewer_sms.log2_waves > fits.log2_waves
    # Rows below one 64-row MMA tile do the same GEMM work.
    assert (
        _tuning.shape_class("matmul_rs", 8, 2048, 4096, "bfloat16", 2, h200).log2_flop
        == _tuning.shape_class("matmul_rs", 64, 2048, 4096, "bfloat16", 2, h200).log2_flop
    )
    # A faster link makes the same bytes a shorter transfer.
    fast = dataclasses_replace(h200, link_gbps=2 * h200.link_gbps, link_latency_us=0.0)
    slow = dataclasses_replace(h200, link_latency_us=0.0)
    assert (
        _tuning.shape_class("ag_matmul", 8192, 8192, 4096, "bfloat16", 2, fast).log2_transfer_us
        == _tuning.shape_class("ag_matmul", 8192, 8192, 4096, "bfloat16", 2, slow).log2_transfer_us - 1
    )


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def _block():
    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)

    def block(x, w1, w2):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp")
        return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp")

    fn = jax.shard_map(block, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))
    z = functools.partial(jnp.zeros, dtype=jnp.bfloat16)
    return fn, (z((64, 32)), z((32, 128)), z((128, 32)))


def test_shapes_of_a_function_and_of_a_model_preset():
    shapes = flux_jax.tune.function_shapes(_block)
    assert [(s.op, s.M, s.K, s.N, s.tp, s.dtype) for s in shapes] == [
        ("ag_matmul", 64, 32, 128, 4, "bfloat16"),
        ("matmul_rs", 64, 128, 32, 4, "bfloat16"),
    ]
    from benchmarks.presets import _llama_layers

    ours = [(op, k, n) for op, k, n, _ in flux_jax.tune._models.layers("llama3-8b")]
    theirs = [({"ag": "ag_matmul", "rs": "matmul_rs"}[op], k, n) for op, k, n, _ in _llama_layers("8B")]
    assert ours == theirs
    preset = flux_jax.tune.model_shapes("llama3-70b", [64, 4096], [2, 4], ["bfloat16"])
    assert len(preset) == 2 * 4 * 2 and {s.tp for s in preset} == {2, 4}


def test_a_table_the_tool_writes_loads_again(tmp_path):
    """The device's link figures are kept as the file stores them (3 decimals): a shape class
    computed from the measured values equals the one a reader recomputes, even next to a class
    boundary (10.7060796 us rounds across one). The speedups are kept as the file stores them too
    (5 significant digits), so the path was chosen by the numbers a reader sees (1.019996 is 1.02
    there)."""
    device = _tuning.Device("cpu", "cpu", 2, 1.0, 10.7060796)
    entry = _table.make_entry(device, 2, 2, "float32", "ag_matmul", 8, 8, 8, {"overlap": 1.019996})
    path = tmp_path / "table.json"
    _table.write(path, _table.merged(None, device, [entry]))
    (loaded,) = _tuning.load(str(path)).entries
    assert loaded.shape_class == entry.shape_class
    assert loaded == entry


def test_table_and_tool_errors_name_the_problem(tmp_path):
    bad_text = tmp_path / "latin1.json"
    bad_text.write_bytes(b"\xff\xfe{}")
    with pytest.raises(_tuning.TuningTableError, match=r"latin1.json: is not UTF-8 text"):
        _tuning.load(str(bad_text))
    device = _tuning.Device("cpu", "cpu", 2, 1.0, 10.0)
    entry = _table.make_entry(device, 2, 2, "float32", "ag_matmul", 8, 8, 8, {"overlap": 1.5})
    table = tmp_path / "table.json"
    _table.write(table, _table.merged(None, device, [entry]))
    data = json.loads(table.read_text())
    data["entries"][0]["op"] = "ag_matmull"
    table.write_text(json.dumps(data))
    with pytest.raises(_tuning.TuningTableError, match=r"field 'op' must be one of"):
        _tuning.load(str(table))
    rc, _, err = _tool("--shapes", ",", "--tp", "2", *FAST, "--out", str(tmp_path / "out.json"))
    assert rc == 2 and "no shapes to measure: --shapes, --model or --from named none" in err, err


def _ar_block():
    """Megatron's layout without sequence parallelism: column_matmul -> tanh -> matmul_ar."""
    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)

    def block(x, w1, w2):
        h = flux_jax.column_matmul(x, w1, axis_name="tp")
        return flux_jax.matmul_ar(jnp.tanh(h), w2, axis_name="tp")

    def loss(x, w1, w2):  # the backward holds column_matmul's dx: a matmul_ar over w1's columns
        return jnp.sum(fn(x, w1, w2).astype(jnp.float32) ** 2)

    fn = jax.shard_map(block, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P())
    z = functools.partial(jnp.zeros, dtype=jnp.bfloat16)
    return jax.grad(loss, argnums=(0, 1, 2)), (z((64, 32)), z((32, 128)), z((128, 48)))


def test_matmul_ar_shapes_of_a_function_and_of_a_model_preset():
    shapes = flux_jax.tune.function_shapes(_ar_block)
    assert sorted((s.op, s.M, s.K, s.N, s.tp, s.label) for s in shapes) == [
        ("matmul_ar", 64, 128, 32, 4, "backward"),  # column_matmul's dx = dy w1^T, all-reduced
        ("matmul_ar", 64, 128, 48, 4, "forward"),
    ]
    from benchmarks.presets import _row_parallel_layers

    ours = flux_jax.tune._models.layers("llama3-8b", sequence_parallel=False)
    assert {op for op, *_ in ours} == {"matmul_ar"}
    row_parallel = [(k, n) for op, k, n, label in ours if "dx" not in label]
    assert row_parallel == [(k, n) for _, k, n, _ in _row_parallel_layers("8B")]
    # the column-parallel GEMMs' backward: K = their output columns (sharded), N = their input width
    with_sp = flux_jax.tune._models.layers("llama3-8b")
    assert [(k, n) for _, k, n, label in ours if "dx" in label] == [
        (n, k) for op, k, n, _ in with_sp if op == "ag_matmul"
    ]
    preset = flux_jax.tune.model_shapes("llama3-70b", [64], [2], ["bfloat16"], sequence_parallel=False)
    assert len(preset) == 4 and all(s.op == "matmul_ar" for s in preset)
    # matmul_ar's rows stay whole: any M is valid; its K is sharded
    assert flux_jax.tune.parse_shapes("ar:30x64x32", [4], ["bfloat16"])[0].invalid() is None
    assert "K=62" in flux_jax.tune.parse_shapes("matmul_ar:32x62x32", [4], ["bfloat16"])[0].invalid()


def test_matmul_ar_is_measured_and_auto_follows_its_table(tmp_path):
    path = tmp_path / "ar.json"
    rc, out, err = _tool("--shapes", "ar:64x64x32", "--tp", "4", "--out", str(path), *FAST)
    assert rc == 0, err
    assert "matmul_ar  64x64x32" in out  # the summary table
    raw = json.loads(path.read_text())
    (entry,) = raw["entries"]
    assert entry["op"] == "matmul_ar" and entry["shape"] == {"rows": 64, "k": 16, "n": 32}
    # every fused path ran, with its own custom call, and was checked against the twin
    assert set(entry["max_rel_err"]) == {"overlap", "latency", "decode"}
    assert all(e <= 2e-2 for e in entry["max_rel_err"].values())

    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)
    specs = (P(None, "tp"), P("tp", None))

    def fn():  # a fresh function each time: explain and lowering trace under the active config
        body = functools.partial(flux_jax.matmul_ar, axis_name="tp")
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())

    rng = np.random.default_rng()
    x, w = random_array(rng, (64, 64), jnp.bfloat16), random_array(rng, (64, 32), jnp.bfloat16, scale=0.125)
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    twin = jax.jit(
        jax.shard_map(
            functools.partial(flux_jax.matmul_ar, axis_name="tp", impl="xla"), mesh=mesh, in_specs=specs, out_specs=P()
        )
    )
    for path_name, target in (("latency", "flux_jax_all_reduce"), ("decode", "flux_jax_matmul_ar")):
        table = _rewritten(path, tmp_path / f"{path_name}.json", path_name)
        with flux_jax.config(tuning=table):
            (site,) = flux_jax.explain(fn(), xs, ws)
            assert site.plan.path == path_name and site.plan.decided_by == f"tuning table {table}"
            assert f'custom_call_target="{target}"' in jax.jit(fn()).lower(xs, ws).compile().as_text()
            out = jax.jit(fn())(xs, ws)
        assert_matches(out, to64(x) @ to64(w), twin(xs, ws), "bfloat16", f"matmul_ar auto ({path_name} table)")
    with flux_jax.config(tuning=_rewritten(path, tmp_path / "twin.json", "twin")):
        assert 'custom_call_target="flux_jax_' not in jax.jit(fn()).lower(xs, ws).compile().as_text()


def test_fp8_calls_are_measured_and_auto_follows_their_table(tmp_path):
    path = tmp_path / "fp8.json"
    rc, out, err = _tool(
        "--shapes", "ag:64x64x64,rs:64x64x64", "--tp", "4", "--dtype", "fp8", "--out", str(path), *FAST
    )
    assert rc == 0, err
    assert re.search(r"ag_matmul +64x64x64 +4 +fp8 ", out), out  # the summary table
    raw = json.loads(path.read_text())
    assert sorted((e["op"], e["dtype"]) for e in raw["entries"]) == [
        ("ag_matmul", "float8_e4m3fn"),
        ("matmul_rs", "float8_e4m3fn"),
    ]
    for entry in raw["entries"]:  # every FP8 path ran and was checked against the FP8 twin
        assert set(entry["max_rel_err"]) == {"overlap", "latency", "decode"}
        assert all(e <= 2e-2 for e in entry["max_rel_err"].values())

    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)
    rng = np.random.default_rng()
    x, w = random_array(rng, (64, 64), jnp.bfloat16), random_array(rng, (64, 64), jnp.bfloat16, scale=0.125)
    specs = (P("tp", None), P(None, "tp"))
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])

    def fn(fp8=True, impl="auto"):  # a fresh function each time: explain and lowering trace under the config
        body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl, fp8=fp8)
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))

    fp8_twin = jax.jit(fn(impl="xla"))(xs, ws)
    # Without a table: the twin (the CPU default), the FP8 twin's XLA GEMM
    assert 'custom_call_target="flux_jax_' not in jax.jit(fn()).lower(xs, ws).compile().as_text()
    for chosen, target in (("overlap", "flux_jax_ag_matmul"), ("latency", "flux_jax_all_gather")):
        table = _rewritten(path, tmp_path / f"{chosen}.json", chosen)
        with flux_jax.config(tuning=table):
            (site,) = flux_jax.explain(fn(), xs, ws)
            assert site.plan.path == chosen and site.plan.decided_by == f"tuning table {table}", site
            assert f'custom_call_target="{target}"' in jax.jit(fn()).lower(xs, ws).compile().as_text()
            out = jax.jit(fn())(xs, ws)
            # the table's FP8 entries say nothing of the same shape without FP8
            (plain,) = flux_jax.explain(fn(fp8=None), xs, ws)
            assert plain.plan.path == "twin" and plain.plan.decided_by == "platform"
        assert_matches(out, to64(fp8_twin), fp8_twin, "bfloat16", f"FP8 auto ({chosen} table)")
    with flux_jax.config(tuning=_rewritten(path, tmp_path / "twin.json", "twin")):
        (site,) = flux_jax.explain(fn(), xs, ws)
        assert site.plan.path == "twin" and "measured at this shape class" in site.plan.reason
        # impl="fused" under a table that chose the twin: the best fused path it measured
        (forced,) = flux_jax.explain(fn(impl="fused"), xs, ws)
        assert (
            forced.plan.path in ("overlap", "latency", "decode")
            and "measured at this shape class" in forced.plan.reason
        )


@pytest.mark.skipif(
    "ag_matmul" not in flux_jax.build_info()["cuda_kernels"], reason="plans GPU calls: needs a CUDA build"
)
def test_fp8_calls_no_table_holds_say_so_on_gpus():
    for dtype, rows in ((jnp.float16, "float8_e4m3fn"), (jnp.bfloat16, "float8_e5m2")):
        problem = _plan.Problem("ag_matmul", 4096, 8192, 2048, np.dtype(dtype), 2, "cuda", fp8=rows)
        plan = _plan.plan(problem, "auto", flux_jax.Config())
        name = np.dtype(dtype).name
        assert plan.path == "twin" and f"no tuning table holds FP8 calls with {rows} rows of {name} x" in plan.reason
    problem = _plan.Problem("ag_matmul", 4096, 8192, 2048, np.dtype(jnp.bfloat16), 2, "cuda", fp8="float8_e4m3fn")
    assert "python -m flux_jax.tune --dtype fp8" in _plan.plan(problem, "auto", flux_jax.Config()).reason


def test_fp8_shape_classes_and_function_shapes():
    device = _tuning.Device("H", "gpu", 132, 100.0, 10.0)
    ag = [_tuning.moved_bytes("ag_matmul", 4096, 8192, 4096, d, 2) for d in ("bfloat16", _tuning.FP8)]
    rs = [_tuning.moved_bytes("matmul_rs", 4096, 8192, 4096, d, 2) for d in ("bfloat16", _tuning.FP8)]
    assert ag[1] == 2048 * (8192 + 4) and ag[0] == 2048 * 8192 * 2  # e4m3 rows and their float32 scales
    assert rs[1] == rs[0]  # the partial travels in x's dtype
    classes = [_tuning.shape_class("ag_matmul", 4096, 8192, 4096, d, 2, device) for d in ("bfloat16", _tuning.FP8)]
    assert classes[1].log2_transfer_us < classes[0].log2_transfer_us and classes[1].log2_flop == classes[0].log2_flop

    def fp8_block():
        fn, args = _block()
        return lambda *a: jax.grad(lambda *b: jnp.sum(fp8_fn(*b).astype(jnp.float32)))(*a), args

    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)

    def fp8_fn(x, w1, w2):
        def block(x, w1, w2):
            h = flux_jax.ag_matmul(x, w1, axis_name="tp", fp8=True)
            return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", fp8=True)

        return jax.shard_map(block, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))(
            x, w1, w2
        )

    shapes = flux_jax.tune.function_shapes(fp8_block)
    # the forward's e4m3 calls; the backward's (dy in e5m2) have no table entries to tune
    assert sorted((s.op, s.M, s.K, s.N, s.dtype, s.label) for s in shapes) == [
        ("ag_matmul", 64, 32, 128, "fp8", "forward"),
        ("matmul_rs", 64, 128, 32, "fp8", "forward"),
    ]

    def float32_fp8_block():  # FP8 on float32 x only: no table describes it, and the error says so
        fn = jax.shard_map(
            lambda x, w: flux_jax.ag_matmul(x, w, axis_name="tp", fp8=True),
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=P("tp"),
        )
        return fn, (jnp.zeros((64, 32), jnp.float32), jnp.zeros((32, 128), jnp.float32))

    with pytest.raises(flux_jax.tune.TuneError, match=r"only flux_jax calls \(ag_matmul with fp8 on float32 x"):
        flux_jax.tune.function_shapes(float32_fp8_block)


def _rows_table(tmp_path, tp, k, n, small, large, small_path, large_path):
    """A CPU table for ag_matmul (float32): `small` rows -> `small_path`, `large` -> `large_path`."""
    entries = [
        _table.make_entry(
            _cpu_device(),
            8,
            tp,
            "float32",
            "ag_matmul",
            rows,
            k,
            n,
            {"overlap": 0.9} if path == "twin" else {path: 1.5},
            path=path,
        )
        for rows, path in ((small, small_path), (large, large_path))
    ]
    return _write(tmp_path, entries)


@pytest.mark.parametrize(
    "layout", ["manual region over dp", "manual region, the twin for the whole batch", "vmap over x"]
)
def test_auto_plans_for_the_rows_each_device_runs(tmp_path, layout):
    """A partially manual shard_map traces the automatic axes' whole batch, and vmap traces one
    example; the device runs a shard of the batch, or every example in one call. The call is
    planned for the rows the device runs (the region's shard when traced, the vmapped batch when
    lowered): the table's entry for those rows decides, explain names them, the result is right."""
    tp, dp, batch, seq, k, f = 4, 2, 4, 64, 32, 64
    rng = np.random.default_rng()
    w = random_array(rng, (k, f), jnp.float32)
    if layout.startswith("manual region"):
        mesh = jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
        fn = jax.shard_map(
            lambda x, w: flux_jax.ag_matmul(x, w, axis_name="tp", axis=1),
            mesh=mesh,
            in_specs=(P(None, "tp"), P(None, "tp")),
            out_specs=P(None, None, "tp"),
            axis_names={"tp"},
        )
        x = jax.device_put(random_array(rng, (batch, seq, k), jnp.float32), jax.NamedSharding(mesh, P("dp", "tp")))
        traced, runs = batch * seq, batch * seq // dp
        whole = "twin" if "twin" in layout else "overlap"
        table = _rows_table(tmp_path, tp, k, f // tp, runs, traced, "latency", whole)
    else:
        mesh = cpu_mesh((tp,), ("tp",), AxisType.Auto)
        one = functools.partial(flux_jax.ag_matmul, axis_name="tp")
        fn = jax.shard_map(
            lambda x, w: jax.vmap(one, in_axes=(0, None))(x, w),
            mesh=mesh,
            in_specs=(P(None, "tp"), P(None, "tp")),
            out_specs=P(None, None, "tp"),
        )
        x = random_array(rng, (batch, seq, k), jnp.float32)
        traced, runs = seq, batch * seq
        table = _rows_table(tmp_path, tp, k, f // tp, traced, runs, "decode", "overlap")
    with flux_jax.config(tuning=table):
        explained = flux_jax.explain(fn, x, w)
        y = jax.jit(fn)(x, w)
        lowered = jax.jit(fn).lower(x, w).as_text()
    assert "custom_call @flux_jax_" in lowered  # fused (the twin is XLA's collectives alone)
    (site,) = explained
    assert site.problem.rows == runs, str(explained)
    assert site.plan.path == ("latency" if layout.startswith("manual region") else "overlap"), str(explained)
    ref = np.einsum("bsk,kn->bsn", to64(x), to64(w))
    np.testing.assert_allclose(to64(y), ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))
