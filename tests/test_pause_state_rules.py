"""The pause-state hold's rules: raised only for the step, restored always, never lowered, silent.

Each rule has a deliberately wrong variant the same check must catch (the pause left in place
after a frozen step; an operator's ``PAUSED_ALL`` lowered to ``PAUSED_NEW``; the state set through
``set_pause_state()``, which logs at INFO every frozen step).
"""

from __future__ import annotations

import logging

import pytest
from vllm.v1.core.sched.interface import PauseState

from balance_testbed import factories, seam_differential
from vllm_balance.compat.pause_state import PauseStateHold
from vllm_balance.log import LOGGER_NAME

CAP = 2


def pause_state_scheduler(cls=None):
    cls = cls or seam_differential.balance_on_each_path()["pause-state"]
    scheduler = factories.make_scheduler(
        cls,
        data_parallel_size=2,
        max_num_seqs=CAP,
        additional_config={"enable_balance_scheduling": True},
    )
    factories.add_requests(scheduler, factories.make_requests(1))
    scheduler.balance_gate.set_gathered([0, 0])
    factories.step(scheduler)  # req-0 runs: one slot free
    factories.add_requests(scheduler, factories.make_requests(1, start=1))
    return scheduler


def variant(wrong: type) -> type:
    right = seam_differential.balance_on_each_path()["pause-state"]
    return type(wrong.__name__, (wrong, *right.__bases__[1:]), {})


class NotRestored(PauseStateHold):
    def _hold_and_schedule(self, throttle_prefills: bool):
        self._pause_state = PauseState.PAUSED_NEW
        return self._upstream_schedule(throttle_prefills), True


class LowersOperatorPause(PauseStateHold):
    def _hold_and_schedule(self, throttle_prefills: bool):
        operator = self._pause_state
        self._pause_state = PauseState.PAUSED_NEW
        try:
            return self._upstream_schedule(throttle_prefills), True
        finally:
            self._pause_state = operator


class LogsEveryStep(PauseStateHold):
    def _hold_and_schedule(self, throttle_prefills: bool):
        self.set_pause_state(PauseState.PAUSED_NEW)
        try:
            return self._upstream_schedule(throttle_prefills), True
        finally:
            self._pause_state = PauseState.UNPAUSED


def check_restored_after_a_frozen_step(cls=None):
    scheduler = pause_state_scheduler(cls)
    scheduler.balance_gate.set_gathered([1, CAP])
    output = scheduler.schedule()
    assert output.scheduled_new_reqs == [] and scheduler.balance_gate.deferred
    assert scheduler.pause_state == PauseState.UNPAUSED
    assert scheduler.get_num_unfinished_requests() == 2  # as upstream counts outside the step
    scheduler.balance_gate.set_gathered([1, 0])
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["req-1"]


def check_operator_pause_kept(cls=None):
    scheduler = pause_state_scheduler(cls)
    scheduler.set_pause_state(PauseState.PAUSED_ALL)  # /pause?mode=keep
    scheduler.balance_gate.set_gathered([1, CAP])
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {}, "PAUSED_ALL schedules nothing, frozen or not"
    assert scheduler.pause_state == PauseState.PAUSED_ALL


def check_silent(caplog, cls=None):
    scheduler = pause_state_scheduler(cls)
    scheduler.balance_gate.set_gathered([1, CAP])
    with caplog.at_level(logging.INFO):  # any logger: a twin module logs under its own name
        scheduler.schedule()
    assert not [r for r in caplog.records if "pause state" in r.getMessage()]


def test_the_pause_is_restored_after_a_frozen_step():
    check_restored_after_a_frozen_step()


def test_the_pause_is_restored_when_upstreams_step_raises(monkeypatch):
    scheduler = pause_state_scheduler()
    scheduler.balance_gate.set_gathered([1, CAP])
    scheduler.kv_cache_manager.new_step_starts = lambda: (_ for _ in ()).throw(RuntimeError("x"))
    with pytest.raises(RuntimeError, match="x"):
        scheduler.schedule()
    assert scheduler.pause_state == PauseState.UNPAUSED


def test_an_operators_pause_is_never_lowered():
    check_operator_pause_kept()


def test_a_frozen_step_logs_nothing_about_the_pause(caplog):
    check_silent(caplog)


@pytest.mark.parametrize(
    ("wrong", "check"),
    [
        (NotRestored, check_restored_after_a_frozen_step),
        (LowersOperatorPause, check_operator_pause_kept),
    ],
    ids=["not_restored", "lowers_operator_pause"],
)
def test_negative_control_a_wrong_pause_fails_its_check(wrong, check):
    with pytest.raises(AssertionError):
        check(variant(wrong))


def test_negative_control_set_pause_state_logs_every_step(caplog):
    probe = pause_state_scheduler()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        probe.set_pause_state(PauseState.PAUSED_NEW)
    if not caplog.records:
        pytest.skip("this vLLM's set_pause_state() logs nothing: no line to flood")
    caplog.clear()
    with pytest.raises(AssertionError):
        check_silent(caplog, variant(LogsEveryStep))


# Which hold the installed vLLM gets: its schedule()'s entry, or pause-state with a warning.


def _entry(fingerprint, **fields):
    from vllm_balance.compat.derive import VerifiedRef

    return VerifiedRef(release="x", fingerprint=fingerprint, date="", evidence="", **fields)


def test_an_unverified_schedule_gets_the_pause_state_hold_with_a_warning(monkeypatch, caplog):
    from vllm_balance.compat import pause_state

    monkeypatch.delenv(pause_state.HOLD_ENV, raising=False)
    monkeypatch.setattr(pause_state, "verified_holds", lambda: {})
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert pause_state.hold_for_installed_vllm() == pause_state.PAUSE_STATE
    [line] = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert "is not verified" in line and "nox -s reach -- --versions " in line, line


def test_an_unverified_schedule_that_ignores_the_pause_state_is_refused(monkeypatch):
    """A renamed pause attribute would make every frozen step a silent no-op."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_balance.compat import pause_state

    monkeypatch.delenv(pause_state.HOLD_ENV, raising=False)
    monkeypatch.setattr(pause_state, "verified_holds", lambda: {})
    assert pause_state.schedule_reads_pause_state()
    monkeypatch.setattr(Scheduler, "schedule", lambda self, throttle_prefills=False: None)
    with pytest.raises(RuntimeError, match="does not read self._pause_state"):
        pause_state.hold_for_installed_vllm()


@pytest.mark.parametrize("hold", ["pause-state", "derived-copy", None])
def test_a_verified_schedule_gets_the_hold_its_entry_names(monkeypatch, caplog, hold):
    from vllm_balance.compat import pause_state

    monkeypatch.delenv(pause_state.HOLD_ENV, raising=False)
    fields = {"hold": hold} if hold is not None else {}
    entry = _entry(pause_state.installed_schedule_fingerprint(), **fields)
    monkeypatch.setattr(pause_state, "verified_holds", lambda: {entry.fingerprint: entry})
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert pause_state.hold_for_installed_vllm() == (hold or pause_state.DERIVED_COPY)
    assert not [r for r in caplog.records if r.name == LOGGER_NAME]


@pytest.mark.parametrize("forced", ["pause-state", "derived-copy"])
def test_the_hold_env_overrides_the_record_with_a_warning(monkeypatch, caplog, forced):
    from vllm_balance.compat import pause_state

    recorded = pause_state.DERIVED_COPY if forced == pause_state.PAUSE_STATE else "pause-state"
    entry = _entry(pause_state.installed_schedule_fingerprint(), hold=recorded)
    monkeypatch.setattr(pause_state, "verified_holds", lambda: {entry.fingerprint: entry})
    monkeypatch.setenv(pause_state.HOLD_ENV, forced)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert pause_state.hold_for_installed_vllm() == forced
    [line] = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert f"VLLM_BALANCE_HOLD={forced} overrides" in line, line


def test_a_misspelled_hold_env_is_refused(monkeypatch):
    from vllm_balance.compat import pause_state

    monkeypatch.setenv(pause_state.HOLD_ENV, "pause_state")
    with pytest.raises(ValueError, match="VLLM_BALANCE_HOLD must be pause-state or derived-copy"):
        pause_state.hold_for_installed_vllm()
