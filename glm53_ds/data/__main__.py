"""`python -m glm53_ds.data prepare [training options]`: build the token caches a run with the same options reads,
ahead of it, on any CPU machine (no GPU, no DeepSpeed started).

It takes the trainer's command line (or `--config run.toml`) as it is, so the caches are those of that run: the
same `--data`, `--valid-data`, `--tokenizer`, `--data-columns`, `--seq-length`, `--pack`, `--long-documents` and
`--data-cache` (default `<--output-dir>/data_cache`); options that do not shape the data are read and ignored.
`--data-workers` defaults to every core here. A run started while this builds waits on the cache's lock and then
reads it."""

from __future__ import annotations

import os
import sys
import time

from ..training.args import build_parser
from ..training.config import SetupError
from ..training.data import Building, load_tokenizer, open_stream
from ..training.mixture import parse_sources
from ..training.option_checks import resolve_config
from ..training.run_file import parse_with_config
from ..training.run_plan import model_config
from .columns import parse_column_map
from .prepare import default_workers

USAGE = "usage: python -m glm53_ds.data prepare [the options of launch/train.py: --data ... --tokenizer ...]"


def prepare(argv: list[str]) -> int:
    parser = build_parser()
    parser.prog = "python -m glm53_ds.data prepare"
    args, _ = parse_with_config(parser, argv)
    config = resolve_config(args)
    begun = time.perf_counter()
    vocab = model_config(config).vocab_size
    tokenizer = load_tokenizer(config.tokenizer)
    sources = parse_sources(config.data)
    columns = parse_column_map(config.data_columns or (), [s.path for s in sources])
    cache_dir = config.data_cache or os.path.join(config.output_dir, "data_cache")
    building = Building(config.data_workers or default_workers(), builder=True, progress=True)
    print(f"data: preparing into {cache_dir} with {building.workers} workers", file=sys.stderr)
    todo = [(sources, "--data")] + ([(parse_sources([config.valid_data], "--valid-data"), "--valid-data")]
                                    if config.valid_data else [])  # fmt: skip
    for entries, option in todo:
        stream = open_stream(entries, tokenizer, cache_dir, config.seq_length, config.seed, vocab, config.pack,
                             config.long_documents, columns, building, option)  # fmt: skip
        for line in stream.notices:
            print(line, file=sys.stderr)
        kind = "packed rows" if stream.packed else f"windows of {config.seq_length} tokens"
        print(f"prepared {option} {' '.join(config.data if option == '--data' else [str(config.valid_data)])}: "
              f"{stream.num_samples} samples ({kind}) in {time.perf_counter() - begun:.1f} s")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] != "prepare":
        print(USAGE, file=sys.stderr)
        return 2
    try:
        return prepare(argv[1:])
    except (SetupError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
