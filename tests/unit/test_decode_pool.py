"""The decode stack's work pool (kernels/csrc/pool.h): when it rests its helper threads because other work competes
for the cores. The verdict is a function of each program's wall time and the calling thread's CPU time in it, so
it is checked on given times, not on a loaded machine."""

from __future__ import annotations

from tokenmill import kernels

MS = 1e-3
FULL, STARVED = (10 * MS, 9.9 * MS), (10 * MS, 7 * MS)  # the caller got 99% / 70% of a core


def rests(ops: kernels.Kernels, programs: list[tuple[float, float]]) -> list[bool]:
    return list(ops.module.contention_rests(programs))


def test_one_starved_program_is_a_hiccup_two_in_a_row_are_competition(ops: kernels.Kernels) -> None:
    assert rests(ops, [FULL, STARVED, FULL, STARVED, FULL]) == [False] * 5
    assert rests(ops, [FULL, STARVED, STARVED]) == [False, False, True]
    assert rests(ops, [(10 * MS, 8 * MS)] * 3) == [False] * 3  # 80% of a core is enough


def test_after_a_rest_one_starved_program_rests_again(ops: kernels.Kernels) -> None:
    # the first program after a rest tries the helpers: starved again, they rest again at once
    assert rests(ops, [STARVED, STARVED, STARVED]) == [False, True, True]
    # ... and a full one clears the suspicion
    assert rests(ops, [STARVED, STARVED, FULL, STARVED, FULL]) == [False, True, False, False, False]


def test_programs_too_short_to_measure_say_nothing(ops: kernels.Kernels) -> None:
    short = (150e-6, 10e-6)
    assert rests(ops, [STARVED, short, STARVED]) == [False, False, True]  # not a break in the run either
    assert rests(ops, [short] * 4) == [False] * 4
