"""The decode stack's work pool (kernels/csrc/stack/pool.h): when it rests its helper threads because other work
competes for the cores (the verdict is a function of each program's wall time and the calling thread's CPU time in
it, so it is checked on given times, not on a loaded machine), and what a chunk that throws leaves behind."""

from __future__ import annotations

from tokenmill import kernels

MS = 1e-3
FULL, STARVED = (10 * MS, 9.9 * MS), (10 * MS, 7 * MS)  # one-row decode steps: the caller got 99% / 70% of a core


def rests(ops: kernels.Kernels, programs: list[tuple[float, float]]) -> list[bool]:
    return list(ops.module.contention_rests(programs))


def test_a_hiccup_in_one_step_is_not_competition(ops: kernels.Kernels) -> None:
    # windows of two 10 ms steps: one starved step leaves its window at 84.5% of a core
    assert rests(ops, [FULL, STARVED, STARVED, FULL, FULL, STARVED]) == [False] * 6
    assert rests(ops, [(10 * MS, 8.5 * MS)] * 4) == [False] * 4  # 85% of a core in every step is no competition
    # a core lost for 3 ms among 1 ms programs: 17 of the window's 20 ms
    assert not any(rests(ops, [(4 * MS, 1 * MS)] + [(1 * MS, 1 * MS)] * 30))


def test_competition_rests_the_helpers(ops: kernels.Kernels) -> None:
    assert rests(ops, [STARVED, STARVED]) == [False, True]
    assert rests(ops, [FULL, FULL, STARVED, STARVED]) == [False, False, False, True]
    # short programs that another process starves one in three: the window shows it
    pattern = [(1 * MS, 1 * MS), (1 * MS, 1 * MS), (1 * MS, 0.2 * MS)] * 10
    verdicts = rests(ops, pattern)
    assert any(verdicts) and not any(verdicts[:19])  # once 20 ms of programs are in


def test_after_a_rest_one_program_decides_alone(ops: kernels.Kernels) -> None:
    # the first program after a rest tries the helpers: starved again, they rest again at once
    assert rests(ops, [STARVED, STARVED, STARVED, STARVED]) == [False, True, True, True]
    # ... and a full one ends the suspicion: windows of two again
    assert rests(ops, [STARVED, STARVED, FULL, STARVED, FULL]) == [False, True, False, False, False]


def test_programs_too_short_to_measure_say_nothing(ops: kernels.Kernels) -> None:
    short = (150e-6, 10e-6)
    assert rests(ops, [STARVED, short, STARVED]) == [False, False, True]
    assert rests(ops, [short] * 40) == [False] * 40


def test_a_chunk_that_throws_fails_its_program_and_nothing_after(ops: kernels.Kernels) -> None:
    """Chunk k of a program's second stage throws, on whichever thread claims it (the caller or a helper, 1 or 3
    helpers): run() rethrows it once the stage is drained, no later stage runs, and the pool's next program runs
    whole, as if nothing had happened."""
    chunks, full = 64, 64 * 65 // 2  # each stage's sum when every chunk c adds c + 1
    for helpers in (1, 3):
        for k in (0, 5, 31, 63):
            sums, error = ops.module.pool_selftest(helpers, 4, chunks, k)
            assert error == f"pool selftest: chunk {k} threw"
            assert sums[0] == full and sums[1] <= full - (k + 1) and sums[2:] == [0, 0]
            assert ops.module.pool_selftest(helpers, 4, chunks, -1) == ([full] * 4, "")
