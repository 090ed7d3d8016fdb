"""argparse types for the bench commands' counts and lengths: a 0 or a negative value is one usage line at once (a
run of `--repeat 0` recorded NaN, `--num-prompts 0` a rate of 0.0, `probe --seconds -1` a peak of garbage)."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: allowed an integer >= 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{value} is invalid: allowed a finite number > 0")
    return value
