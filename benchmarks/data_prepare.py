"""`fivefold data prepare`: peak memory against corpus size, and speed against the `tokenizers`
library's own batch encoder on the same documents and cores.

Corpora are generated JSONL (random words, documents of 50-2,000 words) of the sizes asked.

- memory (`--memory-gb 0.5,2`): each size prepared in a fresh process with `--workers`
  workers; printed: the parent's peak RSS and the largest worker's (ru_maxrss). Flat in the
  corpus size means equal within 10 %. By default with a word-level tokenizer (`--tokenizer`),
  so that large corpora take minutes on a small machine.
- speed (`--speed-mb 64`, `--cores 1,2`, `--rounds 3`): per core count N, in fresh
  processes, (a) the baseline: every document already in memory, one
  `Tokenizer.encode_batch` call with RAYON_NUM_THREADS=N (reading, writing and checksums not
  counted), then in the same process one `encode_batch_fast` call (the same ids without
  character offsets; what prepare encodes with where `tokenizers` has it); (b)
  `prepare_shards` with N workers, everything counted (reading JSONL, encoding, writing
  shards, checksums, manifest).
  Rounds interleave the settings (each round runs every N's pair in turn); printed per run,
  then per N the medians: MB/s of each, CPU seconds (user + system, workers included), the
  ratios (b)/(a) of wall time and of CPU time (on a loaded machine only the latter compares
  per core; also against `encode_batch_fast`), prepare's wall-clock speed-up over the first
  N (worker scaling: idle machine only), and the load average at the start and the end.

    PYTHONPATH=src .venv/bin/python benchmarks/data_prepare.py --memory-gb 0.25,1 --speed-mb 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = [
    "".join(
        random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=random.Random(-i).randint(2, 9))
    )
    for i in range(5000)
]


def make_corpus(path: Path, megabytes: float) -> Path:
    """A JSONL file of about `megabytes` MB (10^6 bytes) of random documents."""
    rng = random.Random(0)
    target = int(megabytes * 1e6)
    block = "".join(
        json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(50, 2000)))}) + "\n"
        for _ in range(400)
    )
    with path.open("w") as out:
        written = 0
        while written < target:
            out.write(block)
            written += len(block)
    return path


def _child(code: str, env: dict | None = None) -> dict:
    """Run `code` (prints one JSON line) in a fresh interpreter; its parsed output."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


PREPARE = """
import json, resource, time
from pathlib import Path
from fivefold.train.data import default_tokenizer, load_tokenizer, prepare_shards
tok = load_tokenizer(Path({tok!r})) if {tok!r} else default_tokenizer()
def cpu():
    return sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime
               for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
cpu0, started = cpu(), time.perf_counter()
out = prepare_shards([Path({src!r})], Path({out!r}), tok, workers={workers}, overwrite=True,
                     piece_bytes={piece})
seconds, cpu_s = time.perf_counter() - started, cpu() - cpu0
manifest = json.loads((out / "manifest.json").read_text())
print(json.dumps({{"seconds": seconds, "cpu_s": cpu_s, "tokens": manifest["num_tokens"],
    "self_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}}))
"""

BASELINE = """
import json, resource, time
from pathlib import Path
from fivefold.train.data import default_tokenizer, load_tokenizer, read_documents
tok = load_tokenizer(Path({tok!r})) if {tok!r} else default_tokenizer()
docs = list(read_documents({src!r}))
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
def run(encode):
    cpu0, started = cpu(), time.perf_counter()
    encoded = encode(docs, add_special_tokens=False)
    return time.perf_counter() - started, cpu() - cpu0, sum(len(e.ids) + 1 for e in encoded)
seconds, cpu_s, tokens = run(tok.backend.encode_batch)
fast = getattr(tok.backend, "encode_batch_fast", tok.backend.encode_batch)
fast_s, fast_cpu_s, fast_tokens = run(fast)
assert fast_tokens == tokens
print(json.dumps({{"seconds": seconds, "cpu_s": cpu_s, "tokens": tokens,
                   "fast_s": fast_s, "fast_cpu_s": fast_cpu_s}}))
"""


def word_tokenizer(root: Path) -> str:
    """A word-level tokenizer of the corpus's words (fast: what is measured is then
    `prepare_shards`'s own memory and overhead, not byte-level BPE)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
    vocab |= {"<|endoftext|>": len(vocab), "[UNK]": len(vocab) + 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(root / "words.json"))
    return str(root / "words.json")


def memory(root: Path, sizes: list[float], workers: int, tok: str, piece: int) -> None:
    for gb in sizes:
        src = make_corpus(root / f"m{gb}.jsonl", gb * 1000)
        out = root / f"m{gb}-shards"
        code = PREPARE.format(src=str(src), out=str(out), workers=workers, piece=piece, tok=tok)
        got = _child(code)
        print(
            f"memory {gb:g} GB ({src.stat().st_size / 1e9:.2f} GB, {got['tokens']:,} tokens, "
            f"{got['seconds']:.0f} s, {workers} workers): parent peak RSS "
            f"{got['self_rss_mb']:.0f} MB, largest worker {got['worker_rss_mb']:.0f} MB",
            flush=True,
        )
        src.unlink()
        subprocess.run(["rm", "-rf", str(out)], check=True)


def _speed_round(src: Path, root: Path, n: int, tok: str) -> tuple[dict, dict]:
    """One (baseline, prepare) pair on `n` cores, each in a fresh process."""
    base = _child(BASELINE.format(src=str(src), tok=tok), {"RAYON_NUM_THREADS": str(n)})
    piece = max(1 << 20, int(src.stat().st_size / (4 * n)) + 1)
    ours = _child(
        PREPARE.format(src=str(src), out=str(root / "s-out"), workers=n, piece=piece, tok=tok),
        {"RAYON_NUM_THREADS": "1"},
    )
    assert ours["tokens"] == base["tokens"], (ours, base)
    return base, ours


def speed(root: Path, megabytes: float, cores: list[int], tok: str, rounds: int) -> None:
    """`rounds` rounds, each running every core count's pair in turn (interleaved, so a change
    of load hits every setting alike); medians per core count."""
    src = make_corpus(root / "s.jsonl", megabytes)
    mb = src.stat().st_size / 1e6
    runs: dict[int, list[tuple[dict, dict]]] = {n: [] for n in cores}
    print(f"load average at start: {_load()}", flush=True)
    for r in range(rounds):
        for n in cores:
            base, ours = _speed_round(src, root, n, tok)
            runs[n].append((base, ours))
            print(
                f"round {r + 1}, {n} core(s): encode_batch {base['seconds']:.1f} s "
                f"{base['cpu_s']:.1f} CPU-s, encode_batch_fast {base['fast_s']:.1f} s "
                f"{base['fast_cpu_s']:.1f} CPU-s, prepare {ours['seconds']:.1f} s "
                f"{ours['cpu_s']:.1f} CPU-s",
                flush=True,
            )
    print(f"load average at end: {_load()}", flush=True)
    first, first_s = cores[0], _medians(runs[cores[0]])["ours_s"]
    for n in cores:
        med = _medians(runs[n])
        print(
            f"speed {mb:.0f} MB on {n} core(s), medians of {rounds}: tokenizers encode_batch "
            f"{mb / med['base_s']:.2f} MB/s ({med['base_cpu_s']:.2f} CPU-s), prepare "
            f"{mb / med['ours_s']:.2f} MB/s ({med['ours_cpu_s']:.2f} CPU-s): "
            f"{med['base_s'] / med['ours_s']:.2f}x wall, "
            f"{med['base_cpu_s'] / med['ours_cpu_s']:.2f}x per CPU-second (target >= 0.9; "
            f"against encode_batch_fast ({med['fast_cpu_s']:.2f} CPU-s): "
            f"{med['fast_cpu_s'] / med['ours_cpu_s']:.2f}x); "
            f"prepare {first_s / med['ours_s']:.2f}x as fast as on {first} core(s) (linear: "
            f"{n / first:.2f}x; wall clock, so only meaningful on an idle machine)",
            flush=True,
        )


def _medians(pairs: list[tuple[dict, dict]]) -> dict[str, float]:
    """Medians of the baseline's and prepare's wall and CPU seconds over the rounds."""
    return {
        "base_s": statistics.median(b["seconds"] for b, _ in pairs),
        "base_cpu_s": statistics.median(b["cpu_s"] for b, _ in pairs),
        "fast_cpu_s": statistics.median(b["fast_cpu_s"] for b, _ in pairs),
        "ours_s": statistics.median(o["seconds"] for _, o in pairs),
        "ours_cpu_s": statistics.median(o["cpu_s"] for _, o in pairs),
    }


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-gb", default="0.5,2", help="corpus sizes in GB, or ''")
    parser.add_argument("--workers", type=int, default=2, help="workers for the memory runs")
    parser.add_argument("--piece-mb", type=int, default=64, help="piece size for the memory runs")
    parser.add_argument("--speed-mb", type=float, default=64, help="corpus for speed, 0: none")
    parser.add_argument("--cores", default="1,2", help="core counts for the speed runs")
    parser.add_argument(
        "--rounds", type=int, default=3, help="speed rounds (interleaved; medians printed)"
    )
    parser.add_argument(
        "--tokenizer",
        default="bpe,words",
        help="for speed, then memory: bpe (the default 4096-token byte-level BPE) or words (a "
        "word-level tokenizer of the generated words)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        toks = {"bpe": "", "words": word_tokenizer(root)}
        speed_tok, memory_tok = (toks[name] for name in args.tokenizer.split(","))
        if args.speed_mb:
            cores = [int(c) for c in args.cores.split(",")]
            speed(root, args.speed_mb, cores, speed_tok, args.rounds)
        if args.memory_gb:
            sizes = [float(g) for g in args.memory_gb.split(",")]
            memory(root, sizes, args.workers, memory_tok, args.piece_mb << 20)


if __name__ == "__main__":
    main()
