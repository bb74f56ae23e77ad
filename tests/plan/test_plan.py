"""The planner (`glm53_ds/plan/`): its parameter counts against the model built for real, its training-state bytes
against what DeepSpeed engines hold (exact: weights, fp32 masters and Adam moments, every ZeRO stage, bf16 and
fp32, LoRA and full; per rank at EP2 over four ranks, where ZeRO partitions), the released model's exact counts,
and the command line.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

import glm53_ds
from glm53_ds.layers.lora import LoraSpec
from glm53_ds.layers.lora_targets import apply_lora
from glm53_ds.plan import count_parameters, state_bytes
from glm53_ds.plan.__main__ import main as plan_main
from glm53_ds.plan.run import PlannedRun
from glm53_ds.training.presets import glm53_flash, tiny
from glm53_ds.training.trainable import select_trainable
from tests.cli import module_run
from tests.dist_harness import run_world

DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
      "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}  # fmt: skip


def _nbytes(tensors) -> int:  # type: ignore[no-untyped-def]
    return sum(t.numel() * t.element_size() for t in tensors)


def engine_state(stage: int, bf16: bool, lora: int, layout=None) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """One step of the tiny model's engine; the bytes it holds: weights, fp32 masters, Adam moments."""
    cfg = tiny()
    torch.manual_seed(0)
    extra = (
        {}
        if layout is None
        else dict(expert_model_parallel_size=layout.ep, pg_collection=layout.pg_collection)
    )
    model = glm53_ds.build_model(cfg, dtype=torch.bfloat16 if bf16 else torch.float32, **extra)
    if lora:
        apply_lora(model, LoraSpec(rank=lora, alpha=2.0 * lora))
    select_trainable(model, lora=bool(lora), trainable=None, freeze=None, train_indexer=False)
    config = dict(DS, zero_optimization={"stage": stage}, bf16={"enabled": bf16})
    engine = glm53_ds.build_engine(model, config, layout=layout)
    ids = torch.randint(1, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(ids, labels=ids))
    engine.step()
    opt = engine.optimizer
    optimizers = [getattr(opt, "optimizer", opt)]
    if engine.fp32_params is not None and engine.fp32_params.optimizer is not None:
        optimizers.append(engine.fp32_params.optimizer)
    moments = _nbytes([t for o in optimizers for s in o.state.values() for k, t in s.items()
                       if k in ("exp_avg", "exp_avg_sq")])  # fmt: skip
    masters = 0
    for attr in (
        "single_partition_of_fp32_groups",
        "fp32_groups",
    ):  # ZeRO 1 / 2; FP16_UnfusedOptimizer (bf16, 0)
        if hasattr(opt, attr):
            masters = _nbytes([t for g in getattr(opt, attr) for t in (g if isinstance(g, list) else [g])])
            break
    weights = _nbytes(list(engine.module.parameters()) + list(engine.module.buffers()))
    return dict(weights=weights, masters=masters, moments=moments)


CASES = [(0, False, 0), (1, False, 0), (2, False, 0), (0, True, 0), (1, True, 0), (2, True, 0), (1, True, 4),
         (2, False, 4)]  # fmt: skip


@pytest.mark.parametrize("stage, bf16, lora", CASES)
def test_state_bytes_are_what_the_engine_holds(stage, bf16, lora):
    measured = engine_state(stage, bf16, lora)
    planned = state_bytes(
        count_parameters(PlannedRun.for_model(tiny(), lora_rank=lora)), 1, 1, 1, stage, bf16
    ).as_dict()
    assert {k: planned[k] for k in measured} == measured


def test_counts_are_the_built_models():
    cfg = tiny()
    for lora in (0, 4):
        model = glm53_ds.build_model(cfg)
        if lora:
            apply_lora(model, LoraSpec(rank=lora, alpha=8.0))
        select_trainable(model, lora=bool(lora), trainable=None, freeze=None, train_indexer=False)
        counts = count_parameters(PlannedRun.for_model(cfg, lora_rank=lora))
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        assert sum(counts.trained.values()) == trained and sum(counts.frozen.values()) == frozen
        assert counts.total == trained + frozen and counts.buffers == sum(b.numel() for b in model.buffers())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert counts.held("expert") == experts


def test_the_released_models_exact_counts():
    """GLM-5.3-Flash (the released config, MTP included): 320,759,410,430 parameters, 17,762,889,470 of them active
    per token (every non-routed parameter and 8 of 288 routed experts); at EP 32 x ETP 2 one rank holds 1/64 of
    the routed experts' parameters."""
    cfg = glm53_flash()
    whole = count_parameters(PlannedRun.for_model(cfg))
    assert (whole.total, whole.active) == (320_759_410_430, 17_762_889_470)
    sharded = count_parameters(PlannedRun.for_model(cfg, ep=32, etp=2))
    assert sharded.held("expert") * 64 == whole.held("expert")
    assert sharded.held("replicated") == whole.held("replicated")


def rank_state(cases: list[tuple[int, bool, int]]) -> list[dict[str, int]]:
    from tests.dist_harness import setup_ranks

    layout = setup_ranks(2, 1)
    return [engine_state(*case, layout=layout) for case in cases]


@pytest.mark.slow
def test_partitions_per_rank_at_ep2_over_four_ranks(tmp_path):
    """World 4, EP 2: replicated tensors partitioned over 4 ranks, experts over their 2 expert-data-parallel ranks
    (with DeepSpeed's padding: the planner rounds each partition up)."""
    cases = [(1, False, 0), (2, True, 0), (1, True, 4)]
    results = run_world(4, rank_state, tmp_path, cases=cases)
    for i, (stage, bf16, lora) in enumerate(cases):
        planned = state_bytes(
            count_parameters(PlannedRun.for_model(tiny(), ep=2, lora_rank=lora)), 4, 2, 1, stage, bf16
        ).as_dict()
        for rank_result in results:
            measured = rank_result[i]
            assert measured["weights"] == planned["weights"], (stage, bf16, lora, measured, planned)
            for key in ("masters", "moments"):  # padding: within 64 elements of fp32 per group
                assert abs(measured[key] - planned[key]) <= 4 * 64 * (3 if key == "moments" else 1), (
                    stage, bf16, lora, key, measured, planned)  # fmt: skip


def _plan(*args: str) -> dict:
    """The planner as a user runs it (its activation trace joins a fake world: its own process)."""
    run = module_run("glm53_ds.plan", *args, "--json", timeout=600)
    assert run.returncode in (0, 1), run.stderr[-3000:]
    assert len(run.stdout.strip().splitlines()) == 1, run.stdout  # one JSON object and nothing else on stdout
    return json.loads(run.stdout)


def test_the_command_line(capsys):
    result = _plan("--model-config", "tiny", "--world", "2", "--ep", "2", "--zero", "2", "--seq-length", "128",
                   "--recompute", "selective")  # fmt: skip
    state, memory = result["bytes_per_rank"], result["memory"]
    assert state["total"] == sum(state[k] for k in ("weights", "gradients", "masters", "moments"))
    assert memory["total"] == state["total"] + memory["activations"] + memory["communication"]
    assert 0 < memory["activations_saved"] <= memory["activations"] and memory["fits"]
    assert memory["communication"] == 2 * 500_000_000 * 2  # ZeRO-2, overlap_comm: two bf16 buckets
    assert {"linear_attention/dense", "mtp"} <= set(memory["activations_by_kind"])
    network = result["network"]  # the step-time model (tests/plan/test_network.py)
    assert set(network["bytes_per_rank"]) == {"EP", "replicas"} and network["tokens_per_s_per_gpu"] > 0
    assert network["bound"] in ("compute", "EP", "replicas") and result["placement"]["EP"]["nodes"] == 1
    assert plan_main(["--model-config", "tiny", "--world", "3", "--ep", "2", "--seq-length", "128"]) == 2
    assert "world size 3 is not divisible by EP x ETP = 2 x 1" in capsys.readouterr().err
    assert plan_main(["--model-config", "tiny", "--world", "1", "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory 'lots'" in capsys.readouterr().err
    assert plan_main(["--model-config", "tiny", "--world", "3", "--sp", "3", "--seq-length", "128"]) == 2
    assert "seq_length 128 is not divisible by SP = 3" in capsys.readouterr().err
    assert plan_main(["--model-config", "tiny", "--world", "1"]) == 2
    assert "--seq-length 8192 is above the model's max_position_embeddings 4096" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world", "0"], "--world must be >= 1, got 0"),
        (["--world", "8", "--seq-length", "0"], "--seq-length must be >= 1, got 0"),
        (["--world", "8", "--seq-length", "-4"], "--seq-length must be >= 1, got -4"),
        (["--world", "8", "--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        (["--world", "8", "--ep", "0"], "--ep must be >= 1, got 0"),
    ],
)
def test_impossible_numbers_are_one_error_line(argv, message, capsys):
    """Before: the planner and the dry run crashed on these (ZeroDivisionError and friends, a traceback)."""
    assert plan_main(["--model-config", "tiny", "--seq-length", "128", *argv]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {message}", err


def test_the_dry_run_refuses_a_rank_outside_its_world(capsys):
    from glm53_ds.plan.dry_run import main as dry_run_main

    assert dry_run_main(["--model-config", "tiny", "--ep", "2", "--rank", "2", "--seq-length", "64"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: --rank 2 is outside the world of 2 ranks of EP 2 x ETP 1 x SP 1 (0 .. 1)"
    )
    assert dry_run_main(["--model-config", "tiny", "--seq-length", "0"]) == 2
    assert "--seq-length must be >= 1, got 0" in capsys.readouterr().err
    assert dry_run_main(["--model-config", "tiny", "--loss-chunk-mib", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --loss-chunk-mib must be >= 0, got -1"
    assert (
        dry_run_main(
            ["--model-config", "tiny", "--seq-length", "64", "--gpt-model", "--indexer-loss-coef", "0.1"]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("error: --gpt-model with --indexer-loss-coef: ")


def test_search_finds_the_smallest_world_and_only_layouts_that_fit():
    """The tiny model at 4 GB per GPU: world 8 is the smallest tried; every layout listed fits, the cheapest first
    (no recompute before recompute); at 2.1 GB nothing does (ZeRO's two 1 GB buckets are past 92% of it)."""
    result = _plan("--model-config", "tiny", "--search", "--seq-length", "128", "--gpu-memory", "4GB")
    assert result["world"] == 8 and result["fits"]
    assert all(m["fits"] and m["total"] <= 0.92 * 4e9 for m in result["fits"])
    assert result["fits"][0]["layout"]["recompute"] == "none"
    assert result["fits"][0]["trainer_flags"].startswith("--ep ")
    none = _plan("--model-config", "tiny", "--search", "--seq-length", "128", "--gpu-memory", "2.1GB")
    assert (none["world"], none["fits"]) == (0, []) and "nearest" in none  # none: no layout's state even fits


def test_search_in_a_given_world_and_the_trainers_language():
    """Before: `--search --world 8` ignored --world (and answered 32 GPUs after 6 silent minutes); a "does NOT fit"
    said nothing more; the layout was in the planner's words only. Now --world bounds the search, progress goes to
    stderr, each layout comes as the trainer's flags, and a miss names what would fit."""

    def plan(*args: str) -> subprocess.CompletedProcess:  # its own process: the trace joins a fake world
        return module_run("glm53_ds.plan", *args, timeout=600)

    out = plan(
        "--model-config", "tiny", "--search", "--world", "4", "--seq-length", "128", "--gpu-memory", "4GB"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "searching: 4 GPUs:" in out.stderr and "2 GPUs" not in out.stderr
    assert "the smallest world that fits is 4 GPUs" in out.stdout
    assert (
        "deepspeed --num_gpus 4 launch/train.py --ep " in out.stdout
        and "--deepspeed_config ds_configs/" in out.stdout
    )
    out = plan("--model-config", "tiny", "--world", "1", "--seq-length", "4096", "--gpu-memory", "2.35GB",
               "--zero", "1")  # fmt: skip
    assert (
        "does NOT fit" in out.stdout
        and "it would fit with any one of: " in out.stdout
        and "--seq-length 2048: " in out.stdout
    ), out.stdout[-800:] + out.stderr[-2000:]


@pytest.mark.slow
def test_the_released_models_activations_grow_with_the_tokens_and_shrink_with_sp():
    """GLM-5.3-Flash at EP 32 x ETP 2 (meta): kept activations 4x from 8k to 32k tokens (within 1%), a quarter at
    SP 4 (within 10%: SP's all-to-all buffers); full recompute keeps less than selective, selective less than
    none."""
    # a GPU every layout fits: the kept bytes are what is compared, not the planner's hints (a trace each)
    base = ["--world", "256", "--ep", "32", "--etp", "2", "--zero", "2", "--gpu-memory", "100000GB"]
    kept = {}
    for length, sp, mode in [(8192, 1, "none"), (32768, 1, "none"), (32768, 4, "none"), (8192, 1, "selective"),
                             (8192, 1, "full")]:  # fmt: skip
        result = _plan(*base, "--seq-length", str(length), "--sp", str(sp), "--recompute", mode)
        kept[(length, sp, mode)] = result["memory"]["activations_saved"]
    assert abs(kept[(32768, 1, "none")] / kept[(8192, 1, "none")] - 4) < 0.04
    assert abs(kept[(32768, 4, "none")] / kept[(32768, 1, "none")] - 0.25) < 0.025
    assert kept[(8192, 1, "full")] < kept[(8192, 1, "selective")] < kept[(8192, 1, "none")]


@pytest.mark.slow
def test_the_runs_loss_chunk_is_planned():
    """`--loss-chunk-mib` (the trainer's option) is traced as given: the released model at 8k tokens with
    materialised logits (0) needs at least their fp32 [tokens, vocab] more than with the default chunk; on a GPU
    between the two it does not fit, and the planner names the default chunk as what fits; the run's flags carry
    the chunk. Control: the planner had no such option and planned a run file's chunk as the default one."""
    cfg = glm53_flash()
    base = [
        "--world",
        "64",
        "--ep",
        "32",
        "--etp",
        "2",
        "--zero",
        "2",
        "--seq-length",
        "8192",
        "--recompute",
        "full",
    ]
    chunked = _plan(*base, "--gpu-memory", "100000GB")["memory"]["total"]
    gpu = int((chunked + 2**30) / 0.92)  # the default chunk fits with 1 GiB to spare (RESERVE_FRACTION 0.08)
    materialised = _plan(*base, "--loss-chunk-mib", "0", "--gpu-memory", f"{gpu}B")
    assert materialised["memory"]["total"] - chunked >= 8192 * cfg.vocab_size * 4
    assert not materialised["memory"]["fits"] and "--loss-chunk-mib 0 " in materialised["trainer_flags"]
    assert any(hint.startswith("--loss-chunk-mib 256: ") for hint in materialised["would_fit"]), materialised[
        "would_fit"
    ]


def test_the_runs_indexer_loss_is_planned():
    """`--indexer-loss-coef` (the trainer's option) trains the indexer: the planner counts its parameters trained,
    with their gradients, masters and moments, traces its KL loss's kept bytes, names the flag in the run's, and
    refuses full recompute as the trainer does, in one line before any trace. Control: the planner had no such
    option and planned an indexer-loss run file with a frozen indexer."""
    base = ["--model-config", "tiny", "--world", "1", "--seq-length", "1024", "--recompute", "selective"]
    frozen = _plan(*base)
    trained = _plan(*base, "--indexer-loss-coef", "0.1")
    indexer = frozen["parameters"]["frozen"]["replicated"]
    assert indexer > 0 and trained["parameters"]["frozen"]["replicated"] == 0
    assert (
        trained["parameters"]["trained"]["replicated"]
        == frozen["parameters"]["trained"]["replicated"] + indexer
    )
    assert trained["bytes_per_rank"]["masters"] > frozen["bytes_per_rank"]["masters"]
    assert trained["memory"]["activations_saved"] > frozen["memory"]["activations_saved"]
    assert trained["trainer_flags"].endswith(" --indexer-loss-coef 0.1")
    # LoRA: the indexer trains in full beside the adapters, named trainable as the trainer asks
    lora = _plan(*base, "--lora-rank", "8", "--indexer-loss-coef", "0.1")
    assert lora["parameters"]["frozen"]["replicated"] == frozen["parameters"]["trained"]["replicated"]
    assert lora["trainer_flags"].endswith(" --indexer-loss-coef 0.1 --trainable '\\.indexer\\.'")
    refused = module_run("glm53_ds.plan", *base[:-1], "full", "--indexer-loss-coef", "0.1", timeout=600)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: --recompute full with --indexer-loss-coef 0.1: "
    ), refused.stderr[-2000:]


def test_experts_the_trace_cannot_follow_are_one_error_line():
    """At EP 1 a LoRA rank that is not a multiple of 8 sends the experts to the reference loop (a host sync per
    expert): before, a traceback from inside the meta trace (torch.nonzero has no meta kernel); now one line. At EP
    2 the same rank is planned (the dispatcher's path). `--search` skips EP 1 x ETP 1 and says why (control: before,
    the search ended at that layout with the error)."""
    base = ["--model-config", "tiny", "--seq-length", "128", "--lora-rank", "4"]
    refused = module_run("glm53_ds.plan", *base, "--world", "1", timeout=600)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: EP 1 x ETP 1: the experts' sizes (hidden 64, FFN 32, LoRA rank 4) are not all multiples of 8"
    ), refused.stderr[-2000:]
    assert _plan(*base, "--world", "2", "--ep", "2")["memory"]["fits"]
    searched = _plan(*base, "--search", "--world", "2", "--gpu-memory", "10GB")
    assert [reason.split(":")[0] for reason in searched["not_planned"]] == ["EP 1 x ETP 1"], searched
    layouts = {(f["layout"]["ep"], f["layout"]["etp"]) for f in searched["fits"]}
    assert searched["world"] == 2 and (2, 1) in layouts and (1, 1) not in layouts, layouts


def test_a_compiled_run_is_planned_as_eager_and_says_so(tmp_path):
    """A run file with `compile = true`: the planner counts eager's activations (the same total as the run without
    it) and says in one line that this is an upper bound; the control, the same run eager, has no such line."""
    run = tmp_path / "run.toml"
    printed = {}
    for compiled in ("false", "true"):
        run.write_text(f"[model]\ncompile = {compiled}\n", encoding="utf-8")
        proc = module_run("glm53_ds.plan", "--config", str(run), "--model-config", "tiny", "--world", "1",
                          "--seq-length", "256", timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        printed[compiled] = proc.stdout
    said = "the run's --compile: counted as eager, an upper bound"
    assert said in printed["true"] and said not in printed["false"]
    totals = {
        k: next(line for line in out.splitlines() if line.startswith("total ")) for k, out in printed.items()
    }
    assert totals["true"] == totals["false"], totals
