"""The upstream seam changes no behaviour: differential tests of the unpatched vs patched Scheduler.

Both classes come from the installed vLLM (see balance_testbed/seam_differential.py): its own
``Scheduler`` and a copy of its scheduler module with the series applied, or reverted when the
seam sessions have patched the installed vLLM. They run the same workloads and must agree on
every ``SchedulerOutput``, request output and queue state, step by step.

The claim is only as good as the workloads, so the named scenarios are checked to reach each
path it covers (chunked prefill, prefix-cache hits, preemption and resumption under KV pressure,
aborts, max_num_seqs hit, vLLM's DP prefill cadence with a capacity-bound release), and three
deliberately wrong series must be caught by the same comparison.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from balance_testbed import factories
from balance_testbed import seam_differential as differential
from balance_testbed.factories import SHARED_PREFIXES, Divergence
from balance_testbed.lockstep import Req, Workload
from balance_testbed.seam_patch import SEAM_METHOD, seam_stops_before_installed

# The default CI runs this on both pins and with/without the seam: keep it to seconds.
NEUTRALITY_SETTINGS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def requests(arrivals: tuple[int, ...], tail: int, max_tokens: int, prefix: int = 0) -> tuple:
    """One request per arrival step, ``tail`` tokens after shared prefix ``prefix``."""
    return tuple(
        Req(index=i, prefix=prefix, tail=tail, max_tokens=max_tokens, arrive=arrive)
        for i, arrive in enumerate(arrivals)
    )


SCENARIOS = {
    "max_num_seqs_hit": Workload(
        cap=2,
        max_num_batched_tokens=2048,
        num_gpu_blocks=1000,
        enable_prefix_caching=False,
        requests=requests((0, 0, 0, 0, 1, 1), tail=20, max_tokens=6),
    ),
    "chunked_prefill": Workload(
        cap=4,
        max_num_batched_tokens=32,
        num_gpu_blocks=1000,
        enable_prefix_caching=False,
        requests=requests((0, 0, 2), tail=90, max_tokens=4),
    ),
    "prefix_cache_hit": Workload(
        cap=4,
        max_num_batched_tokens=2048,
        num_gpu_blocks=1000,
        enable_prefix_caching=True,
        requests=requests((0, 2, 2, 3), tail=12, max_tokens=4, prefix=2),  # 48 + 12 tokens
    ),
    "kv_pressure_preemption": Workload(
        cap=4,
        max_num_batched_tokens=2048,
        num_gpu_blocks=14,
        enable_prefix_caching=False,
        requests=requests((0, 0, 0, 0), tail=60, max_tokens=30),
    ),
    "aborts": Workload(
        cap=2,
        max_num_batched_tokens=64,
        num_gpu_blocks=1000,
        enable_prefix_caching=True,
        requests=requests((0, 0, 1, 1, 2), tail=8, max_tokens=8, prefix=1),  # 32 + 8 tokens
        aborts=((2, 0), (3, 3), (4, 4)),
    ),
    # vLLM's DP prefill cadence: a release step stops at the cap with requests waiting (so it is
    # capacity-bound), and r0 finishes on a throttled step while r1 still decodes: whether that
    # step may admit depends on the capacity flag the seam series guards.
    "prefill_cadence": Workload(
        cap=2,
        max_num_batched_tokens=2048,
        num_gpu_blocks=1000,
        enable_prefix_caching=False,
        requests=(
            Req(index=0, prefix=0, tail=20, max_tokens=3, arrive=0),
            *(Req(index=i, prefix=0, tail=20, max_tokens=12, arrive=0) for i in range(1, 5)),
        ),
        prefill_interval=2,
    ),
}


@st.composite
def workloads(draw) -> Workload:
    n = draw(st.integers(1, 10))
    prefixes = draw(st.lists(st.sampled_from(range(len(SHARED_PREFIXES))), min_size=n, max_size=n))
    tails_and_max_tokens = [(draw(st.integers(1, 100)), draw(st.integers(1, 24))) for _ in prefixes]
    cap = draw(st.integers(1, 8))
    # Small budgets force chunked prefill; 2048 admits whole prompts.
    max_num_batched_tokens = draw(st.sampled_from((32, 64, 128, 2048)))
    # The largest request needs 11 blocks (148 prompt + 24 output tokens, one null block);
    # a few such requests running together overflow 14..40 blocks and get preempted.
    num_gpu_blocks = draw(st.one_of(st.integers(14, 40), st.just(1000)))
    enable_prefix_caching = draw(st.booleans())
    arrivals = sorted(draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)))
    # Half the workloads throttle prefill as vLLM's DP engine core does (1: never).
    prefill_interval = draw(st.sampled_from((1, 1, 2, 3)))
    return Workload(
        cap=cap,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks=num_gpu_blocks,
        enable_prefix_caching=enable_prefix_caching,
        prefill_interval=prefill_interval,
        requests=tuple(
            Req(index=i, prefix=prefix, tail=tail, max_tokens=max_tokens, arrive=arrive)
            for i, (prefix, (tail, max_tokens), arrive) in enumerate(
                zip(prefixes, tails_and_max_tokens, arrivals)
            )
        ),
        aborts=tuple(
            draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, n - 1)), max_size=3))
        ),
    )


@pytest.fixture(scope="module")
def twins():
    if reason := seam_stops_before_installed():
        pytest.skip(reason)
    return differential.twins()


def test_twins_are_the_installed_scheduler_and_its_counterpart(twins):
    from vllm.v1.core.sched import scheduler as installed

    assert installed.Scheduler in (twins.unpatched, twins.patched)
    assert twins.unpatched is not twins.patched
    assert hasattr(twins.patched, SEAM_METHOD) and not hasattr(twins.unpatched, SEAM_METHOD)


def test_seam_sessions_run_on_a_seamed_vllm(twins):
    """nox's *-seam sessions must really test the patched vLLM, and the others the unpatched."""
    flag = os.environ.get("VLLM_BALANCE_SEAM")  # set by noxfile.install_pinned_vllm
    if flag is None:
        pytest.skip("not under nox (VLLM_BALANCE_SEAM unset)")
    assert twins.installed_is_patched is (flag == "1")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_named_scenario_gives_identical_outputs(twins, name):
    steps = differential.compare(twins.unpatched, twins.patched, SCENARIOS[name])
    assert steps > 1


def test_named_scenarios_reach_every_path_the_claim_covers(twins):
    # An exception of the unpatched scheduler would fail this test (lockstep raises it).
    reached = {
        name: differential.reached(twins.unpatched, workload)
        for name, workload in SCENARIOS.items()
    }
    assert "cap_reached_with_waiting" in reached["max_num_seqs_hit"]
    assert "chunked_prefill" in reached["chunked_prefill"]
    assert "prefix_cache_hit" in reached["prefix_cache_hit"]
    assert {"preemption", "resumption"} <= reached["kv_pressure_preemption"]
    assert {"abort", "cap_reached_with_waiting"} <= reached["aborts"]
    cadence = {"cap_reached_with_waiting", "prefill_capacity_bound", "throttled_with_waiting"}
    assert cadence <= reached["prefill_cadence"]


@NEUTRALITY_SETTINGS
@given(workload=workloads())
def test_randomized_workloads_give_identical_outputs(workload):
    if reason := seam_stops_before_installed():
        pytest.skip(reason)
    twins = differential.twins()
    differential.compare(twins.unpatched, twins.patched, workload)


# Each wrong series, and the named scenario that must catch it.
MUTANTS = {
    "off_by_one_gt": "max_num_seqs_hit",
    "cap_minus_one": "max_num_seqs_hit",
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_negative_control_wrong_seam_diverges_on_named_scenarios(twins, mutant):
    wrong = differential.mutant(twins.patched_source, mutant)
    caught = []
    for name, workload in SCENARIOS.items():
        try:
            differential.compare(twins.unpatched, wrong, workload)
        except Divergence:
            caught.append(name)
    assert MUTANTS[mutant] in caught


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_negative_control_wrong_seam_fails_the_randomized_test(twins, mutant):
    wrong = differential.mutant(twins.patched_source, mutant)

    # The same property as above, pointed at the wrong seam; no shrinking (it only costs time).
    @settings(NEUTRALITY_SETTINGS, phases=[Phase.generate])
    @given(workload=workloads())
    def wrong_seam_is_neutral(workload):
        differential.compare(twins.unpatched, wrong, workload)

    with pytest.raises(Divergence):
        wrong_seam_is_neutral()


# What a hold does (the seam's docstring): the call and the default only, no policy in core.


def one_per_step(base: type) -> type:
    """A third-party override that admits at most one new request per step."""

    class OneAdmissionPerStep(base):
        def schedule(self, throttle_prefills: bool = False):
            self.asked = 0
            return super().schedule(throttle_prefills)

        def _should_stop_admitting_waiting(self) -> bool:
            self.asked += 1
            return self.asked > 1

    return OneAdmissionPerStep


def admitted_with_one_arrival_per_step(scheduler_cls: type, cadence: str, steps: int = 40) -> int:
    """Requests admitted in ``steps`` steps, one arriving before each, prefill every 2nd step:
    vLLM's own cadence at DP = 1 (``prefill_schedule_interval``, 0.33+), or the DP engine core's
    (``throttle_prefills`` on off-cadence steps, every release)."""
    import balance_sim.builders as builders

    config = builders.make_vllm_config(moe=False, max_num_seqs=64)
    if cadence == "local":
        config.scheduler_config.prefill_schedule_interval = 2
    scheduler = factories.make_scheduler(scheduler_cls, vllm_config=config)
    if cadence == "local" and getattr(scheduler, "local_prefill_interval", 1) != 2:
        pytest.skip("this vLLM has no prefill cadence of its own at DP = 1 (0.33+)")
    admitted = 0
    for step in range(steps):
        factories.add_requests(scheduler, factories.make_requests(1, start=step, max_tokens=200))
        output = scheduler.schedule(throttle_prefills=cadence == "engine" and step % 2 == 1)
        admitted += len(output.scheduled_new_reqs)
        scheduler.update_from_output(output, factories.model_runner_output(output, scheduler))
    return admitted


@pytest.mark.parametrize("cadence", ["local", "engine"])
def test_a_hold_is_not_a_capacity_limit_in_core(twins, cadence):
    """An override admitting one request per step keeps up with one arrival per step under the
    prefill cadence: the cadence's saturation escape (#44558) sees the backlog, as it would
    without the override. (With the previous series' exclusion: 20 of 40, the backlog growing.)"""
    assert admitted_with_one_arrival_per_step(one_per_step(twins.patched), cadence) >= 39


def test_a_hold_schedules_a_finished_remote_kv_load(twins):
    """Under a hold a request whose async KV load finished is scheduled, as under PAUSED_NEW,
    where the release drains such requests first (0.31+); a new request is not."""
    from async_kv_connector import kv_transfer_config, load_finished

    class Held(twins.patched):
        def _should_stop_admitting_waiting(self) -> bool:
            return self.hold

    scheduler = factories.make_scheduler(Held, kv_transfer_config=kv_transfer_config())
    if not hasattr(scheduler, "kv_holding_waiting"):
        pytest.skip("before 0.31 one waiting queue: a hold ends the loop (the seam's docstring)")
    scheduler.hold = False
    factories.add_requests(scheduler, factories.make_requests(1, prefix="kv"))
    output = scheduler.schedule()  # kv-0's load starts; it holds its blocks from here
    runner_output = factories.model_runner_output(output, scheduler)
    scheduler.update_from_output(output, load_finished(runner_output, "kv-0"))
    factories.add_requests(scheduler, factories.make_requests(1, start=1))

    scheduler.hold = True
    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == ["kv-0"]
    assert scheduler.requests["kv-0"] in scheduler.running
    assert scheduler.requests["req-1"].status.name == "WAITING"


HOLD_MUTANTS = {
    "held_not_capacity": test_a_hold_is_not_a_capacity_limit_in_core,
    "kv_holders_held": test_a_hold_schedules_a_finished_remote_kv_load,
}


@pytest.mark.parametrize("mutant", sorted(HOLD_MUTANTS))
def test_negative_control_wrong_hold_fails_its_test(twins, mutant):
    try:
        wrong = differential.mutant(twins.patched_source, mutant)
    except differential.MutantNotApplicable as exc:
        pytest.skip(str(exc))
    kwargs = {"cadence": "engine"} if mutant == "held_not_capacity" else {}
    with pytest.raises(AssertionError):
        HOLD_MUTANTS[mutant](dataclasses.replace(twins, patched=wrong), **kwargs)
