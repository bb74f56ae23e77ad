"""Ranks on nodes (parallel/rank_order.py): a launcher's round-robin numbering renumbered node by node, and which
groups of a layout stay inside a node. The renumbering itself runs across two fake nodes in
tests/engine/test_nodes.py."""

from __future__ import annotations

from glm53_ds.parallel.rank_order import group_spans, node_by_node, node_of_ranks, placement_line


def test_ranks_numbered_node_by_node_are_kept_and_round_robin_ones_renumbered():
    assert node_by_node(["a", "a", "b", "b"]) == [0, 1, 2, 3]
    # srun --distribution=cyclic: launcher ranks 0, 2 on a, 1, 3 on b -> a's ranks 0, 1; b's 2, 3
    assert node_by_node(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert node_by_node(["b", "a", "a", "b", "c", "c"]) == [0, 2, 3, 1, 4, 5]  # nodes by their lowest rank
    assert node_of_ranks(["b", "a", "a", "b"]) == [0, 1, 1, 0]


def test_the_layout_keeps_etp_then_sp_and_ep_inside_a_node_where_they_fit():
    node = [r // 8 for r in range(16)]  # 2 nodes x 8 GPUs
    spans = {s.name: (s.size, s.nodes) for s in group_spans(node, ep=4, etp=2, sp=2)}
    assert spans == {
        "ETP": (2, 1),
        "SP": (2, 1),
        "EP": (4, 1),
        "expert DP": (2, 2),
        "DP": (8, 2),
        "replicas": (16, 2),
    }
    spans = {s.name: (s.size, s.nodes) for s in group_spans(node, ep=16, etp=1, sp=8)}
    assert spans == {"SP": (8, 1), "EP": (16, 2), "replicas": (16, 2)}  # EP 16 cannot fit 8 GPUs
    # control: ranks numbered round-robin over the nodes put every ETP pair on both nodes, and at ETP 1 every SP
    # and EP group
    cyclic = [r % 2 for r in range(16)]
    assert {s.name: s.nodes for s in group_spans(cyclic, ep=4, etp=2, sp=2)}["ETP"] == 2
    spans = {s.name: s.nodes for s in group_spans(cyclic, ep=4, etp=1, sp=2)}
    assert spans["SP"] == spans["EP"] == 2
    renumbered = [0] * 16
    for launcher_rank, rank in enumerate(node_by_node([f"n{r % 2}" for r in range(16)])):
        renumbered[rank] = cyclic[launcher_rank]
    assert renumbered == node


def test_the_placement_line():
    assert placement_line([0, 0, 1, 1], ep=2, etp=1, sp=2) == (
        "placement: 2 nodes x 2 ranks; inside a node: SP 2, EP 2; across nodes: expert DP 2 (2 nodes), "
        "replicas 4 (2 nodes)")  # fmt: skip
    assert placement_line([0, 0, 0, 1], ep=1, etp=1, sp=1) == (
        "placement: 2 nodes of 3/1 ranks; inside a node: none; across nodes: expert DP 4 (2 nodes), replicas 4 "
        "(2 nodes)")  # fmt: skip
