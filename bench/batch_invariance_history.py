"""Whether a song's codes depend on what the engine ran before it (GPU): scenarios of
tests/test_batch_invariance_gpu.py in a given order on one talker, each against the first run, with a solo run
between them. A solo run that parts from the first points at state left behind (a recompile, a cache), not at the
scenario's batch; recompiles are logged with the scenario they happen in.

    PYTHONPATH=src python3 bench/batch_invariance_history.py \
        "solo,in pair 1,beside idle graph rows,solo,moved to pair 0"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_batch_invariance_gpu as scenarios  # noqa: E402  (its songs, scenarios and run loop)


def first_differing(a: torch.Tensor, b: torch.Tensor) -> int | None:
    rows = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero()
    return rows[0].item() if len(rows) else None


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("order", help=f"comma-separated: solo or one of {', '.join(scenarios.SCENARIOS)}")
    args = parser.parse_args()
    torch._logging.set_logs(recompiles=True)
    talker = scenarios.make_talker()
    first = None
    for name in args.order.split(","):
        started = time.perf_counter()
        print(f"=== {name}", file=sys.stderr, flush=True)  # recompiles below this line happened in this run
        arrival, beside = (0, []) if name == "solo" else scenarios.SCENARIOS[name]
        codes, mixed = scenarios.run(talker, scenarios.the_song(arrival), beside)
        if codes is None:
            print(f"{name:24s} the song did not finish", flush=True)
            continue
        first = first or (codes, mixed)
        print(f"{name:24s} codes part from frame {first_differing(codes, first[0])}, conditioning from frame "
              f"{first_differing(mixed, first[1])} ({time.perf_counter() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
