"""Command line: `python -m course_lib doctor` (environment check), `python -m course_lib grade [NOTEBOOKS]` (a
learner's scorecard: `course_lib.tools.grade`) and
`python -m course_lib bench [names...] [--quick] [--out DIR]` (every benchmark present, or the ones named:
`course_lib.bench.registry`)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="report versions and device; fail on known-bad combinations")
    bench = sub.add_parser("bench", help="run course_lib's benchmarks (GPU) and record them")
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: every one present)")
    bench.add_argument("--quick", action="store_true", help="a small grid, for a smoke test")
    bench.add_argument("--out", default="assets/benchmarks", help="folder for the record")
    sub.add_parser("grade", help="run a learner's notebooks headless and print a scorecard (grade --help)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["grade"]:
        from .tools.grade import main as grade_main

        return grade_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import doctor

        return 0 if doctor() else 1
    if args.command == "bench":
        from .bench.registry import main as bench_main

        return bench_main(args.names, quick=args.quick, out=args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
