"""How long the layout search takes: Llama 3 405B on 16,384 H100s (the issue's 2 s target).

    python benchmarks/plan_search_speed.py [--repeat N] [--no-explain]

Prints wall and CPU seconds per run (the first run includes filling the caches, later runs in
the same process reuse the per-model ones), the number of layouts considered and costed in
full, and the chosen layout. Also times the Vizz scenario of seed 000.
"""

from __future__ import annotations

import argparse
import time

from fivefold.planner import estimate as estimate_module
from fivefold.planner.search import search
from fivefold.spec import cluster_preset, model_preset

CASES = (
    ("llama3-405b", "dgx-h100", 16384, 16 * 2**20),
    ("vizz-7b", "dgx-h100", 64, 4 * 2**20),
)


def run(name: str, cluster_name: str, gpus: int, tokens: int, explain: bool) -> None:
    model, cluster = model_preset(name), cluster_preset(cluster_name, gpus)
    wall, cpu = time.perf_counter(), time.process_time()
    result = search(model, cluster, global_batch_tokens=tokens, explain=explain)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        f"{name} on {gpus} x {cluster.gpu}: {wall:.2f} s wall, {cpu:.2f} s CPU; "
        f"{result.considered:,} layouts considered, {result.evaluated} costed in full, "
        f"{result.pruned_by_bound:,} skipped by the bound"
    )
    print(f"  best: {result.best_plan.describe()}")
    print(f"  {result.best.tokens_per_s:,.0f} tokens/s, MFU {result.best.mfu:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (default 1)")
    parser.add_argument("--no-explain", action="store_true", help="time the search alone")
    args = parser.parse_args()
    for case in CASES:
        for _ in range(args.repeat):
            estimate_module._layer_costs.cache_clear()  # each run starts cold
            run(*case, explain=not args.no_explain)


if __name__ == "__main__":
    main()
