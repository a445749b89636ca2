"""Compare two seed repeats of train.py (`--seeds N`) seed by seed: `python compare_seeds.py A B`.

For each metric both hold: the mean of B - A over the seeds they share, its 95% interval (Student's t), and
for the task's main metric on how many seeds B did better. A command of its own, not a flag of train.py: it
trains nothing and takes none of train.py's settings, only the two folders."""

from __future__ import annotations

import argparse
from pathlib import Path

from machinery import stops
from machinery.seeds import compare, comparison_table


def main(argv: list[str] | None = None) -> dict | None:
    with stops.one_line(" while comparing; nothing was written", program=__name__ == "__main__"):
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("a", help="a folder of `train.py --seeds N`: the baseline")
        parser.add_argument("b", help="another, with the change; the differences are B - A")
        args = parser.parse_args(argv)
        result = compare(Path(args.a), Path(args.b))
        print(comparison_table(result))
        return result


if __name__ == "__main__":
    main()
