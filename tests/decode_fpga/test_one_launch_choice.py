"""How the engine chooses between one launch and launch by launch for a one-sequence decode step
(services/decode_fpga/one_launch_choice.py), on scripted step times and a scripted clock; the real
engine's give-up and redo are in test_decode_layers.py and test_paged_step.py."""
from __future__ import annotations

from services.decode_fpga.one_launch_choice import OneLaunchChoice

QUIET = {True: 0.005, False: 0.010}  # one launch twice as fast, as on an idle CPU here
BUSY = {True: 0.090, False: 0.013}  # a busy core: one launch stalls at its barriers


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(choice: OneLaunchChoice, clock: Clock, times: dict[bool, float], n: int, gave_up: bool = False) -> list[bool]:
    """n steps at the scripted times, 10 ms of clock each; the way each ran."""
    ways = []
    for _ in range(n):
        way = choice.one_launch()
        ways.append(way)
        choice.record(way, times[way], gave_up=gave_up and way)
        clock.now += 0.010
    return ways


def test_a_quiet_machine_keeps_one_launch_and_tries_the_other_way_ever_more_rarely():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    ways = run(choice, clock, QUIET, 1000)  # 10 s of steps
    assert choice.current is True and choice.switches == 0
    # tries 0.25 s after the first step, then at 0.5, 1, 2 and 4 s intervals: 3 slow steps each
    assert ways.count(False) == 5 * 3
    assert choice.state()["next_try_s"] == 8.0


def test_a_busy_spell_turns_it_to_launch_by_launch_at_once_and_a_quiet_one_back():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    run(choice, clock, QUIET, 350)  # has timed both ways (tries at 1 and 3 s; the next at 7 s)
    ways = run(choice, clock, BUSY, 30)
    # three slow steps of the last five show one launch slower than launch by launch was; three
    # steps of each, side by side, confirm it
    assert ways[:9] == [True] * 3 + [False] * 3 + [True] * 3 and choice.current is False
    assert ways[9:30].count(True) == 0  # no try of one launch within its first quarter second
    run(choice, clock, BUSY, 500)
    assert choice.current is False and choice.switches == 1
    back = run(choice, clock, QUIET, 400)
    assert choice.current is True and choice.switches == 2
    assert back.index(True) <= 100 * choice.max_probe_s  # found within the try interval


def test_a_step_or_two_slowed_by_something_passing_changes_nothing():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    run(choice, clock, QUIET, 150)
    for _ in range(20):  # every half second, two cold steps (as after a hand-off)
        ways = run(choice, clock, BUSY, 2) + run(choice, clock, QUIET, 48)
        assert ways.count(False) <= 3  # at most a timed try
    assert choice.current is True and choice.switches == 0


def test_a_gain_within_the_margin_is_not_worth_a_change():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    run(choice, clock, {True: 0.010, False: 0.0095}, 1000)
    assert choice.current is True and choice.switches == 0
    run(choice, clock, {True: 0.010, False: 0.0085}, 1000)
    assert choice.current is False and choice.switches == 1


def test_one_give_up_is_tried_but_not_taken_for_a_busy_machine():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    run(choice, clock, QUIET, 150)
    run(choice, clock, QUIET, 1, gave_up=True)
    ways = run(choice, clock, QUIET, 10)
    assert ways[:3] == [False] * 3  # the give-up starts a try of launch by launch
    assert choice.current is True and choice.gave_up == 1  # one infinite step in eight: the median is fast


def test_one_launch_that_always_gives_up_is_left_and_retried_rarely():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    ways = run(choice, clock, QUIET, 6000, gave_up=True)  # 60 s
    assert ways[:7] == [True] + [False] * 3 + [True] * 3 and choice.current is False
    # then tries after 0.25, 0.5, 1, ... 16 s intervals (then every 32 s): three give-ups each
    assert choice.gave_up == ways.count(True) == 4 + 7 * 3


def test_the_way_that_was_never_timed_is_never_preferred():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    clock.now += 3600  # an engine made long before its first step
    assert run(choice, clock, QUIET, 5) == [True] * 5


def test_the_state_for_a_debug_endpoint():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    run(choice, clock, QUIET, 200)
    state = choice.state()
    assert state["one_launch"] is True and state["one_launch_ms"] == 5.0 and state["launch_by_launch_ms"] == 10.0
    assert state["one_launch_steps"] + state["launch_by_launch_steps"] == 200 and state["gave_up"] == 0


def test_a_fixed_way_is_never_tried_against_the_other():
    clock = Clock()
    choice = OneLaunchChoice(clock=clock, fixed=True)
    ways = run(choice, clock, BUSY, 500, gave_up=True)
    assert ways == [True] * 500 and choice.gave_up == 500 and choice.switches == 0


def test_a_change_of_way_is_logged_with_both_times(caplog):
    import logging

    clock = Clock()
    choice = OneLaunchChoice(clock=clock)
    with caplog.at_level(logging.INFO, logger="services.decode_fpga.one_launch_choice"):
        run(choice, clock, QUIET, 1, gave_up=True)
        run(choice, clock, QUIET, 6, gave_up=True)
    assert [r.getMessage() for r in caplog.records] == [
        "decode steps of one sequence now run launch by launch (10.00 ms a step; one launch gave up)"]
