"""The planner and `--offload-activations` (layers/activation_offload.py): the kept layer inputs leave the device.
Its own module: the planner's meta trace joins a fake world, which a module that built a model in-process holds."""

from __future__ import annotations

from glm53_ds.plan.activations import layer_kinds, plan_activations
from glm53_ds.plan.run import PlannedRun
from glm53_ds.training.presets import preset


def test_the_planner_sees_the_kept_inputs_leave_the_device():
    """On meta tensors the offload keeps shapes, not memory: the profile's kept bytes per layer drop by the layer's
    inputs, which the host holds, and the step's peak falls. The control: without offload the same profile keeps
    them (and a tensor below the offload's threshold stays)."""
    cfg = preset("tiny")
    kinds = layer_kinds(cfg)
    run = PlannedRun.for_model(cfg, seq_length=4096, micro_batch_size=1, recompute="full")
    plain = plan_activations(run)
    offloaded = plan_activations(run.variant(offload_activations=True))
    inputs = (
        4096 * cfg.hc_mult * cfg.hidden_size * 2
    )  # a layer's packed streams, bf16 (2 MiB: above min_bytes)
    first = kinds[0]  # its input is the embedding [s, b, D] (512 KiB: below min_bytes, kept on the device)
    assert plain.units[first].saved == offloaded.units[first].saved and offloaded.units[first].host == 0
    for kind in set(plain.units) - {first, "mtp"}:  # the MTP layer is outside the decoder: kept as before
        assert (
            plain.units[kind].saved - offloaded.units[kind].saved == inputs == offloaded.units[kind].host
        ), kind
    assert offloaded.host_saved(kinds) == (len(kinds) - 1) * inputs and plain.host_saved(kinds) == 0
    assert offloaded.peak(kinds) < plain.peak(kinds)
    # what follows the decoder is unchanged: the gap to the MTP layer, the loss head's kept bytes
    assert (offloaded.gap, offloaded.head_saved) == (plain.gap, plain.head_saved)
    # the composition over the model is what its trace ends the forward with, less what the host holds
    assert offloaded.saved(kinds) == plain.saved(kinds) - offloaded.host_saved(kinds)


def test_the_planners_command_line_takes_it(capsys):
    """`python -m glm53_ds.plan --offload-activations`: the host memory beside the GPU total, the flag in the
    trainer's command it prints; refused without full recompute, as the trainer refuses it."""
    import json

    from glm53_ds.plan.__main__ import main

    common = ["--model-config", "tiny", "--world", "1", "--seq-length", "4096", "--json"]
    assert main([*common, "--recompute", "full"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--recompute", "full", "--offload-activations"]) == 0
    offloaded = json.loads(capsys.readouterr().out)
    assert plain["memory"]["host_memory"] == 0 and offloaded["memory"]["host_memory"] > 0
    assert offloaded["memory"]["activations"] < plain["memory"]["activations"]
    assert "--offload-activations" in offloaded["trainer_flags"] and "--offload" not in plain["trainer_flags"]
    assert main([*common, "--recompute", "selective", "--offload-activations"]) == 2
    assert "error: --offload-activations with --recompute selective" in capsys.readouterr().err


def test_a_miss_under_full_recompute_names_the_offload(capsys):
    """A full-recompute layout that fits only with the offload: the planner's "does NOT fit" names it."""
    import json

    from glm53_ds.plan.__main__ import main
    from glm53_ds.plan.memory import RESERVE_FRACTION

    common = [
        "--model-config",
        "tiny",
        "--world",
        "1",
        "--seq-length",
        "4096",
        "--recompute",
        "full",
        "--zero",
        "1",
    ]
    totals = []
    for extra in ([], ["--offload-activations"]):
        assert main([*common, *extra, "--json"]) == 0
        totals.append(json.loads(capsys.readouterr().out)["memory"]["total"])
    between = (totals[0] + totals[1]) / 2 / (1 - RESERVE_FRACTION)  # fits with the offload only
    assert main([*common, "--gpu-memory", f"{between:.0f}"]) == 1  # exit code 1: it does not fit
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "--offload-activations: " in out, out[-1500:]
