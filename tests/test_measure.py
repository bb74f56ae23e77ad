"""benchmarks/measure.py's allocator peak (what `model_step.py --compile` compares on CPU): the most torch's CPU
allocator held at once of what a function allocated, from the profiler's record of each allocation and free (a
block allocated before the function and freed in it is not in the record)."""

from __future__ import annotations

import torch

from benchmarks.measure import allocator_peak_bytes

MIB = 2**20


def test_the_allocator_peak_is_the_most_a_function_allocated_and_held_at_once():
    def step() -> torch.Tensor:
        a = torch.empty(MIB)  # 4 MiB
        b = torch.empty(2 * MIB)  # 8 MiB: 12 held
        del a
        c = torch.empty(MIB // 2)  # 2 MiB: 10 held
        return b + c[0]  # 8 MiB more while b and c live: 18 held, 8 (the result) when it returns

    assert allocator_peak_bytes(step) == 18 * MIB
    held_at_start = [torch.empty(2 * MIB)]

    def frees_then_allocates() -> torch.Tensor:
        held_at_start.pop()  # 8 MiB allocated before the step, freed in it: not in the record
        return torch.empty(2 * MIB)

    assert allocator_peak_bytes(frees_then_allocates) == 8 * MIB
