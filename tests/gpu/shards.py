"""The GPU tests in shards that each fit one machine call: every test's expected duration
(``tests/gpu/durations.tsv``), a fixed assignment of the tests to ``N`` shards, and the table's durations
read back from the logs of runs.

    python tests/gpu/shards.py list [--shards N] [--gpus G]   each shard's tests and expected seconds
    python tests/gpu/shards.py shard I/N [--gpus G]           shard I's pytest node ids, one a line
    python tests/gpu/shards.py update LOG...                  the table's seconds from the logs' durations

``scripts/run_gpu_tests.sh --shard I/N`` runs shard I (``tests/gpu/conftest.py`` deselects the others) and
``--list`` prints the plan. The table has one row per test function
(all its parameters run together) or per parameter where one alone is long (the script runs): its node
id, the GPUs it needs (on fewer it skips at once), its seconds on a machine with 2 GPUs and with 4 or more
(a test that spreads over every GPU takes longer there), and where the seconds come from: a log's
``--durations`` lines (setup, call and teardown added up, every parameter of a function added), or an
estimate where no log records the test. Shards are filled longest test first, each test into the shard
expected to end first, so the same ``N`` always gives the same shards.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "durations.tsv"
#: a machine call runs at most 10 minutes; a shard is planned to end within this many seconds
BUDGET_S = 480
#: the start of a shard's pytest (imports, collection, CUDA initialization), beside its tests
SHARD_START_S = 20
#: a test that needs more GPUs than the machine has: skipped at collection
SKIP_S = 0.5
DURATION = re.compile(r"^([0-9.]+)s (setup|call|teardown) +(tests/gpu/\S+)$", re.M)
GPU_COUNT = re.compile(r"; (\d+) CUDA GPUs$", re.M)


@dataclass(frozen=True)
class Test:
    """One row of the table."""

    node: str
    gpus: int
    seconds: float  # on 2 GPUs (or 1 for a one-GPU test)
    seconds_4: float  # on 4 or more GPUs
    source: str

    def expected(self, gpus: int) -> float:
        if gpus < self.gpus:
            return SKIP_S
        return self.seconds_4 if gpus >= 4 else self.seconds


def load(path: Path = TABLE) -> list[Test]:
    """The table's rows (``#`` lines are comments)."""
    tests = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            node, gpus, seconds, seconds_4, source = line.split("\t")
            tests.append(Test(node, int(gpus), float(seconds), float(seconds_4), source))
    return tests


def save(tests: list[Test], path: Path = TABLE) -> None:
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    rows = [f"{t.node}\t{t.gpus}\t{t.seconds:g}\t{t.seconds_4:g}\t{t.source}" for t in tests]
    path.write_text("\n".join(header + rows) + "\n")


def plan(tests: list[Test], shards: int, gpus: int) -> list[list[Test]]:
    """``tests`` in ``shards`` shards: longest first, each into the shard expected to end first."""
    if shards < 1:
        raise ValueError(f"the shard count must be 1 or more; got {shards}")
    bins: list[list[Test]] = [[] for _ in range(shards)]
    loads = [float(SHARD_START_S)] * shards
    for test in sorted(tests, key=lambda t: (-t.expected(gpus), t.node)):
        i = min(range(shards), key=lambda j: (loads[j], j))
        bins[i].append(test)
        loads[i] += test.expected(gpus)
    return bins


def expected(shard: list[Test], gpus: int) -> float:
    """A shard's expected seconds, its start included."""
    return SHARD_START_S + sum(t.expected(gpus) for t in shard)


def fewest_shards(tests: list[Test], gpus: int, budget: float = BUDGET_S) -> int:
    """The fewest shards that each end within ``budget`` seconds."""
    for shards in range(1, len(tests) + 1):
        if max(expected(s, gpus) for s in plan(tests, shards, gpus)) <= budget:
            return shards
    raise ValueError(f"a single test is expected to take longer than {budget} s")


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)``, 1 <= I <= N; ValueError naming the form otherwise."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"--shard takes I/N with 1 <= I <= N (shard I of N); got {text!r}")
    return int(match[1]), int(match[2])


def durations(log: str) -> dict[str, float]:
    """A log's ``--durations`` seconds per node id (setup, call and teardown added)."""
    found: dict[str, float] = {}
    for seconds, _, node in DURATION.findall(log):
        found[node] = found.get(node, 0.0) + float(seconds)
    return found


def update(tests: list[Test], logs: list[Path]) -> list[Test]:
    """``tests`` with the seconds the logs record (the largest of the logs; a function's parameters
    added), in the column of the log's GPU count, the log named as the source."""
    out = {t.node: t for t in tests}
    for log in logs:
        text = log.read_text()
        count = GPU_COUNT.search(text)
        four = count is not None and int(count[1]) >= 4
        per_row: dict[str, float] = {}
        for node, seconds in durations(text).items():
            row = node if node in out else node.split("[")[0]
            if row in out:
                per_row[row] = per_row.get(row, 0.0) + seconds
        for row, seconds in per_row.items():
            old = out[row]
            column = "seconds_4" if four else "seconds"
            if seconds > getattr(old, column) or old.source.startswith("estimate"):
                source = log.name if old.source.startswith("estimate") else f"{old.source}; {log.name}"
                changed = {column: round(seconds, 1), "source": source}
                if not four and old.seconds_4 <= old.seconds:  # no 4-GPU measurement above it
                    changed["seconds_4"] = round(seconds, 1)
                out[row] = replace(old, **changed)
    return list(out.values())


def detected_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _list(tests: list[Test], shards: int | None, gpus: int) -> str:
    shards = shards or fewest_shards(tests, gpus)
    lines = [f"{shards} shards for {gpus} GPUs (each planned within {BUDGET_S} s, its start of "
             f"{SHARD_START_S} s included):"]
    for i, shard in enumerate(plan(tests, shards, gpus), 1):
        lines.append(f"shard {i}/{shards}: {expected(shard, gpus):.0f} s expected, {len(shard)} tests")
        lines += [f"  {t.expected(gpus):7.1f} s  {t.node}" for t in shard]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="each shard's tests and expected seconds")
    listing.add_argument("--shards", type=int, default=None, help="default: the fewest within the budget")
    one = sub.add_parser("shard", help="the node ids of shard I of N")
    one.add_argument("which", help="I/N")
    for command in (listing, one):
        command.add_argument("--gpus", type=int, default=None, help="default: the GPUs this machine has")
    refresh = sub.add_parser("update", help="the table's seconds from logs of run_gpu_tests.sh")
    refresh.add_argument("logs", nargs="+", type=Path)
    args = p.parse_args(argv)
    tests = load()
    if args.command == "update":
        save(update(tests, args.logs))
        return 0
    gpus = detected_gpus() if args.gpus is None else args.gpus
    if args.command == "list":
        print(_list(tests, args.shards, gpus))
        return 0
    try:
        i, n = parse_shard(args.which)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    print("\n".join(t.node for t in plan(tests, n, gpus)[i - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
