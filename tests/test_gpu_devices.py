"""GPU devices in every phase, checked without a GPU (issue 18): which GPUs a plan uses,
hardware and placement with GPU memory budgets, the environment of a GPU's worker process,
and the engine sending each GPU's models to their own process with their GPU loaders.
What needs CUDA itself (profiling and serving on a GPU) is in benchmarks/gpu_overhead.py and
the CUDA-only tests, which skip here."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from fakes import EnvModel, FakeModel

from ken.engine.serving import Engine
from ken.engine.workers import gpu_index, worker_env
from ken.errors import EngineError, KenError, WorkerError
from ken.models.cascade import Cascade
from ken.models.gpus import GPU_MEMORY_SHARE, Gpu, choose_gpus, gpu_budget_bytes
from ken.models.model import DeviceConfig
from ken.models.quality import EvalSample
from ken.ops.base import ModelOperator, OpContext
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.placement import fits
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.planning import local_hardware, operator_profiles, plan_operator
from ken.optimizer.workload import Hardware, poisson_trace
from ken.policy.plan import GearPlan, RangeSchedule, Replica

GB = 2**30
H100 = (Gpu(0, "NVIDIA H100 80GB HBM3", 80 * GB), Gpu(1, "NVIDIA H100 80GB HBM3", 80 * GB))


def _sample() -> EvalSample:
    return EvalSample("s", ("a", "b"), ("negative", "positive"), "accuracy")


# -- which devices a plan uses ---------------------------------------------------------------


def test_local_hardware_uses_the_gpus_it_sees_unless_cpu_workers_are_asked_for() -> None:
    hw = local_hardware(None, 4.0, visible=H100)  # the default: every GPU seen
    assert hw.ids == ("cuda0", "cuda1") and hw.kinds == ("cuda",)
    assert all(d.memory_bytes == int(80 * GB * GPU_MEMORY_SHARE) for d in hw.devices)
    assert local_hardware(None, 4.0, gpus=1, gpu_memory_gb=20, visible=H100).devices[0] \
        .memory_bytes == 20 * GB
    assert local_hardware(3, 4.0, visible=H100).ids == ("cpu0", "cpu1", "cpu2")
    assert local_hardware(None, 4.0, gpus=0, visible=H100).ids == ("cpu0", "cpu1")
    assert local_hardware(None, 4.0, visible=()).ids == ("cpu0", "cpu1")  # no GPU: 2 CPUs
    with pytest.raises(KenError, match="3 GPU.*sees 2.*cuda:1 NVIDIA H100"):
        local_hardware(None, 4.0, gpus=3, visible=H100)
    with pytest.raises(KenError, match="sees 0.*no CUDA build"):
        local_hardware(None, 4.0, gpus=1, visible=())
    assert local_hardware(0, 4.0, gpus=1, visible=H100).ids == ("cuda0",)
    with pytest.raises(KenError, match="devices must be >= 1"):
        local_hardware(0, 4.0, visible=H100)  # 0 CPU workers asked for, and no GPU
    mixed = local_hardware(2, 4.0, gpus=1, visible=H100)  # both asked for: a mixed machine
    assert mixed.ids == ("cpu0", "cpu1", "cuda0") and mixed.kinds == ("cpu", "cuda")
    with pytest.raises(KenError, match="more than GPU 0"):
        gpu_budget_bytes(H100[0], 81)
    with pytest.raises(KenError, match=">= 0"):
        choose_gpus(-1, H100)


def test_asking_for_a_gpu_this_machine_lacks_fails_before_profiling() -> None:
    """On a machine without a GPU (this CPU build of torch sees none) the real detection
    answers, and nothing is profiled (the model would record a call)."""
    import torch

    import ken

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the error under test is for machines without")
    model = FakeModel("m")
    with ken.connect(builtins=False) as s:
        s.register("mine", model, sample=_sample())
        with pytest.raises(KenError, match="1 GPU.*torch sees 0"):
            s.plan("accuracy >= 0.5", functions=("mine",), gpus=1)
    assert model.calls == []


def test_hardware_local_round_trips_and_names_gpus_by_index() -> None:
    hw = Hardware.local(2, 4 * GB, [80 * GB, 40 * GB])
    assert hw.ids == ("cpu0", "cpu1", "cuda0", "cuda1")
    assert hw.kinds == ("cpu", "cuda")
    assert Hardware.from_json(hw.to_json()) == hw
    assert [gpu_index(d) for d in hw.ids] == [None, None, 0, 1]
    assert gpu_index("n3.cuda2") == 2 and gpu_index("gpu0") is None


# -- placement with GPU memory ---------------------------------------------------------------


def _catalog(memory: dict[str, int], rows: int = 300) -> Catalog:
    rng = np.random.default_rng(1)
    perf, quality, probs = {}, {}, {}
    for i, (name, need) in enumerate(memory.items()):
        p = rng.uniform(0.0, 1.0, rows)
        quality[name] = (p > 0.4 - 0.2 * i).astype(np.float64)
        probs[name] = np.column_stack([p, 1 - p])
        ms = 0.5 * (1 + 4 * i)
        perf[name] = ModelPerf(name, (1, 8, 32), ((ms / 1e3, 2 * ms / 1e3, 5 * ms / 1e3),),
                               (need,))
    return Catalog(perf, quality, probs, "gpu-test")


def test_gpu_plans_place_each_replica_within_its_gpus_memory() -> None:
    """A 30 GB model fits only the 40 GB GPU of an 80/40/10 GB machine beside the others,
    never the 10 GB one; every plan of the frontier fits every GPU's budget."""
    catalog = _catalog({"small": 1 * GB, "large": 30 * GB})
    cascades = [Cascade(("small",), ()), Cascade(("large",), ()),
                Cascade(("small", "large"), (0.7,))]
    hw = Hardware.local(0, 0, [40 * GB, 10 * GB, 10 * GB])
    frontier, _ = plan_frontier("op", cascades, catalog, hw, poisson_trace(400, 5.0, seed=0),
                                settings=PlannerSettings(num_ranges=2, max_rounds=1))
    assert any(r.model == "large" for p in frontier.plans for r in p.placement)
    for plan in frontier.plans:
        assert fits(plan.placement, catalog, hw)
        assert all(r.devices == ("cuda0",) for r in plan.placement if r.model == "large")
    with pytest.raises(KenError, match="largest device has 10,240 MB"):
        plan_operator("op", {}, catalog, cascades, Hardware.local(0, 0, [10 * GB]),
                      poisson_trace(100, 5.0), 100.0, PlannerSettings(num_ranges=1))


def test_profiling_for_a_gpu_refuses_candidates_that_ignore_the_device() -> None:
    """A user operator built from loaded models cannot move them: profiling it for a GPU plan
    says so instead of timing CPU models as if they were on the GPU."""
    op = ModelOperator("mine", Cascade(("m",), ()), {"m": FakeModel("m")}, sample=_sample())
    with pytest.raises(KenError, match="cannot be profiled on cuda0.*load on cpu-1t"):
        operator_profiles(op, OpContext(DeviceConfig()), device=DeviceConfig("cuda", 0))


# -- the worker of a GPU ---------------------------------------------------------------------


def test_worker_env_shows_a_gpu_worker_its_gpu_alone_and_a_cpu_worker_none() -> None:
    base = {"PATH": "/bin"}
    assert worker_env("cuda1", 3, base) == {"PATH": "/bin", "OMP_NUM_THREADS": "3",
                                            "CUDA_VISIBLE_DEVICES": "1"}
    assert worker_env("cpu0", 1, base)["CUDA_VISIBLE_DEVICES"] == ""
    assert worker_env("n2.cuda0", 1, base)["CUDA_VISIBLE_DEVICES"] == "0"
    # GPU 1 of a process that sees physical GPUs 4 and 5 is physical GPU 5
    assert worker_env("cuda1", 1, {"CUDA_VISIBLE_DEVICES": "4, 5"})["CUDA_VISIBLE_DEVICES"] == "5"
    with pytest.raises(WorkerError, match="names GPU 2.*sees 2 GPU"):
        worker_env("cuda2", 1, {"CUDA_VISIBLE_DEVICES": "4,5"})


def _one_stage(operator: str, model: str, device: str) -> GearPlan:
    return GearPlan(operator, (0.0, 1e6), (Cascade((model,), ()),),
                    (Replica(model, (device,)),), (RangeSchedule(0, (1.0,), (1,)),), (4,),
                    max_wait_s=0.005)


def test_engine_runs_each_gpu_in_its_own_process_with_its_gpu_loaders(monkeypatch) -> None:
    """Models on cuda1 load through the GPU loaders, in a process that sees GPU 1 alone;
    models on cpu0 through the CPU loaders, in a process that sees no GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # GPU 1 is then "1"
    plans = [_one_stage("on_cpu", "c", "cpu0"), _one_stage("on_gpu", "g", "cuda1")]
    cpu = {"c": functools.partial(EnvModel, "c")}
    gpu = {"g": functools.partial(EnvModel, "g")}
    with Engine(plans, cpu, gpu_models=gpu, workers="process",
                admission="max_in_flight") as engine:
        got = {op: engine.submit("row", operator=op).result(timeout=60)
               for op in ("on_cpu", "on_gpu")}
        pids = engine.pids()
    assert {op: (o.status, o.value) for op, o in got.items()} == {
        "on_cpu": ("ok", ""), "on_gpu": ("ok", "1")}
    assert pids["cpu0"] != pids["cuda1"]
    with pytest.raises(EngineError, match=r"places \['g'\] on GPUs but no GPU loader"):
        Engine(plans, {**cpu, **gpu}, workers="process")
    with pytest.raises(EngineError, match="served by worker processes"):
        Engine(plans, {"c": EnvModel("c")}, gpu_models={"g": EnvModel("g")}, workers="thread")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_gpu_workers_are_checked_against_the_gpu_memory_they_reserved() -> None:
    """A GPU worker reports the GPU memory its allocator reserved (loading included); over the
    GPU budget the engine refuses to start, naming the device, the models and both sizes."""
    from fakes import GpuHog

    plans = [_one_stage("hog", "g", "cuda0")]
    gpu = {"g": functools.partial(GpuHog, "g", 256)}
    with Engine(plans, {}, gpu_models=gpu, workers="process",
                admission="max_in_flight") as engine:
        held = engine.load_report.gpu_bytes
        assert set(held) == {"cuda0"} and held["cuda0"] >= 256 * 2**20
        assert "cuda0" not in engine.load_report.rss_bytes  # host memory is not the GPU's
        assert engine.submit("row", operator="hog").result(timeout=60).status == "ok"
    tight = Engine(plans, {}, gpu_models=gpu, workers="process", admission="max_in_flight",
                   gpu_memory_budget_bytes=128 * 2**20)
    with pytest.raises(EngineError, match=r"cuda0's worker reserved 2\d\d MB of GPU memory with "
                                          r"g, over its budget of 128 MB \(the GPU has"):
        tight.start()
    assert all(p is None for p in tight.pids().values())


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_a_killed_gpu_worker_frees_its_gpu_memory_for_its_replacement() -> None:
    """A GPU worker holding 55% of the GPU is SIGKILLed between batches: the next rows are
    answered by a fresh worker on the same GPU, which needs that memory again (two such
    workers do not fit). So the dead worker's GPU memory comes back once it is reaped; the
    death is found by the idle check or by the next batch (which goes back unrun, no attempt
    counted, and waits for the reload), and the fresh worker reports the memory it reserved."""
    import os
    import signal
    import time

    import torch
    from fakes import GpuHog

    free, total = torch.cuda.mem_get_info(0)
    mb = int(0.55 * total / 2**20)
    if free < 0.6 * total:
        pytest.skip(f"needs 60% of the GPU free, {free / total:.0%} is")
    plans = [_one_stage("hog", "g", "cuda0")]
    gpu = {"g": functools.partial(GpuHog, "g", mb)}
    with Engine(plans, {}, gpu_models=gpu, workers="process",
                admission="max_in_flight") as engine:
        first = engine.submit("before", operator="hog").result(timeout=120)
        pid = engine.pids()["cuda0"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30.0
        # until the kill can be seen (or the idle check has already replaced the worker)
        while engine.pool._runners["cuda0"].died_idle() is None and \
                engine.worker_restarts == 0 and engine.pids()["cuda0"] == pid:
            assert time.monotonic() < deadline, "the killed GPU worker did not die"
            time.sleep(0.01)
        after = [f.result(timeout=180) for f in
                 [engine.submit(f"after {i}", operator="hog") for i in range(4)]]
        state = (engine.worker_restarts, engine.pool.failed_attempts, engine.pids()["cuda0"])
        held = engine.pool._runners["cuda0"].gpu_usage()
    assert first.status == "ok" and [o.status for o in after] == ["ok"] * 4, after
    assert after[0].value == torch.cuda.get_device_name(0)
    assert state[:2] == (1, 0) and state[2] != pid
    assert held is not None and held[0] >= mb * 2**20 and held[1] == total


def test_cpu_workers_report_no_gpu_memory() -> None:
    plans = [_one_stage("on_cpu", "c", "cpu0")]
    with Engine(plans, {"c": functools.partial(EnvModel, "c")}, workers="process",
                admission="max_in_flight") as engine:
        assert engine.load_report.gpu_bytes == {} and set(engine.load_report.rss_bytes) == {"cpu0"}
    with pytest.raises(EngineError, match="GPU memory budget per GPU must be > 0"):
        Engine(plans, {"c": functools.partial(EnvModel, "c")}, gpu_memory_budget_bytes=0)


# -- CPU workers and GPUs in one plan ----------------------------------------------------------


def _mixed_catalog(rows: int = 400) -> Catalog:
    """A small model (1 ms per row on a CPU worker) and a 2 GB one that is 50x slower there
    than on a GPU, and more accurate."""
    outcomes = _catalog({"small": GB // 10, "big": 2 * GB}, rows)
    cpu = {"small": outcomes.perf["small"],
           "big": ModelPerf("big", (1, 8, 32), ((0.1, 0.4, 1.5),), (2 * GB,))}
    gpu = {"small": ModelPerf("small", (1, 8, 32), ((0.4e-3, 0.5e-3, 0.8e-3),), (GB // 5,)),
           "big": ModelPerf("big", (1, 8, 32), ((2e-3, 3e-3, 6e-3),), (3 * GB,))}
    return outcomes.with_perf(cpu, gpu)


def test_catalog_perf_on_picks_the_gpu_profile_for_gpu_devices() -> None:
    import pickle

    cat = _mixed_catalog()
    assert cat.perf_on("big", "cpu1") is cat.perf["big"]
    assert cat.perf_on("big", ("cuda0",)) is cat.gpu_perf["big"]
    assert cat.perf_on("big", "n3.cuda1") is cat.gpu_perf["big"]
    assert _catalog({"big": GB}).perf_on("big", "cuda0").memory() == GB  # no GPU profile
    back = pickle.loads(pickle.dumps(cat.with_overhead(1e-3)))
    assert back.gpu_perf["big"].batch_runtime(1) == pytest.approx(3e-3)
    assert back.perf["big"].batch_runtime(1) == pytest.approx(cat.perf["big"].batch_runtime(1)
                                                              + 1e-3)
    with pytest.raises(Exception, match="GPU performance must cover"):
        cat.with_perf(dict(cat.perf), {"big": cat.gpu_perf["big"]})


def test_the_simulator_charges_each_replica_its_own_devices_runtime() -> None:
    """One request at a time through the same plan on a CPU worker and on a GPU: each takes
    exactly that device's profiled runtime of one row (brute force)."""
    from ken.optimizer.simulator import simulate
    from ken.optimizer.workload import Trace

    cat = _mixed_catalog()
    trace = Trace(np.arange(20) * 1.0)  # 1 s apart: nothing queues
    for device, perf in (("cpu0", cat.perf["big"]), ("cuda0", cat.gpu_perf["big"])):
        plan = GearPlan("op", (0.0, 1e6), (Cascade(("big",), ()),), (Replica("big", (device,)),),
                        (RangeSchedule(0, (1.0,), (1,)),), (8,), max_wait_s=0.001)
        latency = simulate(plan, cat, trace).latency_s
        assert latency == pytest.approx(np.full(20, perf.batch_runtime(1)))


def test_a_mixed_machine_puts_the_big_model_on_the_gpu_and_beats_cpu_workers_alone() -> None:
    """With two CPU workers and one GPU, the planner places the big model on the GPU (where it
    is 50x faster) and serves the most accurate cascade with a far lower p95 than on the two
    CPU workers alone; with a GPU that holds the big model only, the small one runs on the CPU
    workers. Every plan records the runtimes of the device each replica is on."""
    from ken.optimizer.plan_eval import batch_runtimes
    from ken.optimizer.planning import sustained_qps

    cat = _mixed_catalog()
    cascades = [Cascade(("small",), ()), Cascade(("big",), ()),
                Cascade(("small", "big"), (0.7,))]
    mixed = Hardware.local(2, 4 * GB, [8 * GB])
    cpus = Hardware.cpu_workers(2, 4 * GB)
    assert sustained_qps(cat, cascades[1], mixed) == pytest.approx(
        2 * 32 / 1.5 + 32 / 6e-3)
    trace = poisson_trace(60, 10.0, seed=0)
    settings = PlannerSettings(num_ranges=2, max_rounds=2)
    best = {}
    for name, hw in (("mixed", mixed), ("cpus", cpus)):
        frontier, _ = plan_frontier("op", cascades, cat, hw, trace, qps_max=60.0,
                                    settings=settings)
        for plan in frontier.plans:
            assert fits(plan.placement, cat, hw)
            assert plan.batch_runtime_s == batch_runtimes(cat, plan.placement, plan.max_batch)
        best[name] = max(frontier.plans, key=lambda p: (p.predicted.accuracy,
                                                        -p.predicted.p95_ms))
    top = best["mixed"]
    assert any(r.model == "big" and r.devices == ("cuda0",) for r in top.placement)
    assert top.predicted.accuracy >= best["cpus"].predicted.accuracy
    assert top.predicted.p95_ms < best["cpus"].predicted.p95_ms / 5
    # a GPU with room for the big model alone: the cascades' small stage goes to a CPU worker
    tight = Hardware.local(2, 4 * GB, [3 * GB])
    frontier, _ = plan_frontier("op", cascades, cat, tight, trace, qps_max=60.0,
                                settings=settings)
    both = [p for p in frontier.plans if {r.model for r in p.placement} == {"small", "big"}]
    assert both and all(fits(p.placement, cat, tight) for p in both)
    for plan in both:
        assert {(r.model, r.devices[0][:3]) for r in plan.placement} == {("big", "cud"),
                                                                         ("small", "cpu")}


def test_gpus_found_by_themselves_give_way_to_cpu_workers_for_models_that_cannot_move(
        monkeypatch) -> None:
    """On a GPU machine a plan the user asked nothing of uses the GPUs; an operator made of
    loaded models cannot go there, so it is planned for 2 CPU workers instead (with a note),
    while asking for the GPU explicitly is an error."""
    import ken

    monkeypatch.setattr("ken.optimizer.planning.visible_gpus", lambda: H100)
    notes: list[str] = []
    with ken.connect(builtins=False) as s:
        s.ctx.reporter.note = notes.append  # type: ignore[method-assign]
        s.register("mine", FakeModel("m"), sample=_sample())
        qp = s.plan("accuracy >= 0", functions=("mine",), trace="poisson", peak_qps=5,
                    duration_s=5)
        assert set(qp.plan_for("mine").devices) <= {"cpu0", "cpu1"}
        assert any("instead of the GPUs" in n for n in notes)
        with pytest.raises(KenError, match="cannot be profiled on cuda0"):
            s.plan("accuracy >= 0", functions=("mine",), trace="poisson", peak_qps=5,
                   duration_s=5, gpus=1)
        with pytest.raises(KenError, match="cluster's CPU workers"):
            s.plan("accuracy >= 0", functions=("mine",), cluster="local", gpus=1)


def test_thread_workers_refuse_a_swapped_in_gpu_plan() -> None:
    cpu_plan = _one_stage("op", "c", "cpu0")
    with Engine(cpu_plan, {"c": EnvModel("c")}, workers="thread",
                admission="max_in_flight") as engine:
        with pytest.raises(EngineError, match="served by worker processes"):
            engine.swap_plan(_one_stage("op", "g", "cuda0"), gpu_models={"g": EnvModel("g")})
        assert engine.submit("row").result(timeout=30).status == "ok"  # still serving
