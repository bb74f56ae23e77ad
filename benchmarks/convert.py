"""Conversion throughput and peak memory: hf-to-native (EP2 x ETP2) and native-to-hf on a synthetic checkpoint,
each in its own process (peak RSS over that process's import baseline).

    python3 benchmarks/convert.py [--experts 64] [--layers 12] [--hidden 128]

Peak memory: resident set size sampled every 2 ms over the process's baseline (interpreter, libraries, the
weight-less model definition), beside the streaming bound 2 x (largest stored tensor + output shard size).
Last line: `convert hf_to_native_MBps=<x> native_to_hf_MBps=<y> peak_extra_MiB=<max of both>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import print_table, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Baseline: interpreter, libraries and the weight-less model definition (as tests/convert/test_convert.py measures).
_RUN = """
import json, sys, time
import glm53_ds.model, glm53_ds.convert.import_hf as m
from benchmarks.measure import PeakRss
from glm53_ds.config import Glm53Config
from glm53_ds.convert import hf_to_native, native_to_hf
m.expected_native_shapes(Glm53Config.from_hf(sys.argv[4]), False)
start = time.perf_counter()
with PeakRss() as rss:
    if sys.argv[1] == "hf-to-native":
        hf_to_native(sys.argv[2], sys.argv[3], ep=2, etp=2, shard_bytes=int(sys.argv[5]))
    else:
        native_to_hf(sys.argv[2], sys.argv[3], shard_bytes=int(sys.argv[5]))
print(json.dumps(dict(seconds=time.perf_counter() - start, extra_bytes=rss.extra)))
"""
SHARD_BYTES = 16 << 20


def _largest_tensor_bytes(directory: str) -> int:
    from glm53_ds.checkpoint.safetensors_file import SafetensorsFile

    files = [
        SafetensorsFile(os.path.join(directory, n))
        for n in os.listdir(directory)
        if n.endswith(".safetensors")
    ]
    return max(e["data_offsets"][1] - e["data_offsets"][0] for f in files for e in f.entries.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    from tests.model_fixtures import CONFIG_A, save_tiny_hf

    n = args.layers
    text = dict(CONFIG_A, hidden_size=args.hidden, moe_intermediate_size=args.hidden, intermediate_size=2 * args.hidden,
                n_routed_experts=args.experts, num_hidden_layers=n, layer_types=(CONFIG_A["layer_types"] * n)[:n],
                indexer_types=(CONFIG_A["indexer_types"] * n)[:n], mlp_layer_types=["dense"] * 2 + ["sparse"] * (n - 2))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_hf(os.path.join(tmp, "hf"), text)
        size = sum(
            os.path.getsize(os.path.join(tmp, "hf", f))
            for f in os.listdir(os.path.join(tmp, "hf"))
            if f.endswith(".safetensors")
        )
        bound = 2 * (_largest_tensor_bytes(os.path.join(tmp, "hf")) + SHARD_BYTES) / 2**20
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # see measure.PeakRss
        rows = []
        for step, src, dst in (("hf-to-native", "hf", "native"), ("native-to-hf", "native", "hf2")):
            argv = [sys.executable, "-c", _RUN, step, os.path.join(tmp, src), os.path.join(tmp, dst),
                    os.path.join(tmp, "hf"), str(SHARD_BYTES)]  # fmt: skip
            out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rows.append(dict(step=step, MiB=size / 2**20, seconds=r["seconds"], MBps=size / 1e6 / r["seconds"],
                             peak_extra_MiB=r["extra_bytes"] / 2**20, bound_MiB=bound))  # fmt: skip
    print_table(rows, ["step", "MiB", "seconds", "MBps", "peak_extra_MiB", "bound_MiB"])
    summary = dict(hf_to_native_MBps=rows[0]["MBps"], native_to_hf_MBps=rows[1]["MBps"],
                   peak_extra_MiB=max(r["peak_extra_MiB"] for r in rows))  # fmt: skip
    path = write_results("convert_cpu", dict(rows=rows, summary=summary, shard_bytes=SHARD_BYTES))
    print(f"results: {path}")
    print("convert " + " ".join(f"{k}={v:.1f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
