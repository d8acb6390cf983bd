"""The receive buffers the memory estimate counts beside a pipelined backward, against torch's own
lowering of the interleaved schedule into sends and receives (torch 2.13's `_add_send_recv`, then
`_defer_recv_ops`, which entrypoints/parallel/pipeline.py turns on with defer_pp_recv).

A receive buffer exists from its posted receive to the end of the chunk that consumes it
(_OnDemandReceiveStage). Replaying each rank's lowered actions gives how many are alive when each
of its first two backwards runs (the moments the estimate prices), and at any backward."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _defer_recv_ops
from torch.distributed.pipelining.schedules import _ComputationType as C

from launcher.contract.layout import Layout
from launcher.estimate.pipeline import BackwardMoment, backward_moments, forward_moments, receive_buffers_in_backward

from .memory_tracing import pipeline_actions


def compute_orders(p: int, v: int, m: int) -> dict[int, list[_Action]]:
    """Each rank's forwards and backwards in torch's order, as torch's actions."""
    return {
        rank: [
            _Action(stage, C.FORWARD if kind == "F" else C.FULL_BACKWARD, mb)
            for kind, stage, mb in pipeline_actions(rank, p, v, m, "interleaved_1f1b")
        ]
        for rank in range(p)
    }


def lowered(p: int, v: int, m: int, *, deferred: bool = True) -> dict[int, list[_Action]]:
    with_comms = _add_send_recv(compute_orders(p, v, m), stage_to_rank=lambda s: s % p, num_stages=p * v)
    return _defer_recv_ops(with_comms, stage_to_rank=lambda s: s % p) if deferred else with_comms


def buffers_at_backwards(actions: list[_Action]) -> list[tuple[int, int]]:
    """(stage of the backward, receive buffers alive) at each backward of one rank."""
    alive, found = set(), []
    for action in actions:
        kind, key = action.computation_type, (action.stage_index, action.microbatch_index)
        if kind in (C.RECV_F, C.RECV_B):
            alive.add((kind, *key))
        elif kind == C.FORWARD:
            alive.discard((C.RECV_F, *key))  # the buffer is now the stage's input activation
        elif kind == C.FULL_BACKWARD:
            found.append((action.stage_index, len(alive)))
            alive.discard((C.RECV_B, *key))
    return found


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 3, 8), (4, 2, 8), (4, 5, 16), (8, 5, 64), (8, 2, 8), (3, 2, 12)])
def test_estimate_counts_the_receive_buffers_torchs_lowered_schedule_holds_at_each_backward(p, v, m):
    layout = Layout(pipeline=p, virtual_stages=v, data_shard=1)
    for rank, actions in lowered(p, v, m).items():
        at_backwards = buffers_at_backwards(actions)
        moments = backward_moments(rank, layout, "interleaved_1f1b", m)
        # The first two moments the estimate prices are on the stages torch runs them on...
        assert tuple(at.stage for at in moments[:2]) == tuple(stage for stage, _ in at_backwards[:2])
        # ...with the buffers it counts: the backward's own output gradient, unless last stage.
        for stage, alive in at_backwards[:2]:
            assert alive == receive_buffers_in_backward(stage, layout), (rank, stage)
        # No later backward holds more than one.
        assert max(alive for _, alive in at_backwards) <= 1


def test_without_deferred_receives_torch_would_post_them_early():
    # What defer_pp_recv buys: the as-soon-as-possible lowering leaves the last rank with
    # several gradient buffers posted at once (4 at p = 8).
    p, v, m = 8, 2, 16
    early = lowered(p, v, m, deferred=False)
    assert max(alive for _, alive in buffers_at_backwards(early[p - 1])) >= 3


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 3, 8), (4, 2, 8), (4, 2, 16), (4, 5, 16), (8, 5, 64), (3, 2, 12)])
def test_backward_moments_follow_torchs_order(p, v, m):
    """In flight, outputs held and stages already done at each moment the estimate prices, against
    a replay of torch's own order (`_get_1f1b_rank_ops`, through pipeline_actions)."""
    layout = Layout(pipeline=p, virtual_stages=v, data_shard=1)
    last = p * v - 1
    for rank in range(p):
        in_flight, done, seen, by_stage = [], [], [], []
        for kind, stage, _mb in pipeline_actions(rank, p, v, m, "interleaved_1f1b"):
            if kind == "F":
                in_flight.append(stage)
                continue
            sent = sum(s > 0 for s in done)  # input gradients sent back so far (stage 0 sends none)
            seen.append((stage, len(in_flight), sum(s != last for s in in_flight), tuple(sorted(set(done))), sent))
            by_stage.append(tuple(in_flight.count(rank + x * p) for x in range(v)))
            in_flight.remove(stage)
            done.append(stage)
        moments = backward_moments(rank, layout, "interleaved_1f1b", m)
        for moment in moments:
            fields = (moment.stage, moment.in_flight, moment.outputs, moment.done, moment.sent_gradients)
            assert fields in seen, (rank, moment)
            assert moment.by_stage == by_stage[seen.index(fields)], (rank, moment)
        assert moments[0] == BackwardMoment("first backward", *seen[0])
        # The last moment has every stage of the rank done, with the most in flight that any
        # backward with every stage done has.
        every = [s for s in seen if len(s[3]) == v]
        if every:
            assert moments[-1].in_flight == max(s[1] for s in every)


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 2, 16), (2, 3, 8), (4, 5, 16), (8, 4, 32)])
@pytest.mark.parametrize("weights", [(4.0, 1.0), (1.0, 4.0), (1.0, 3.0, 2.0)])
def test_every_backward_before_all_stages_are_done_is_covered_where_chunks_weigh_differently(p, v, m, weights):
    """Where the rank's stages keep different amounts per chunk (one layer a stage, alternately
    kept and checkpointed), a later backward of a stage already done may hold more than the
    second: the forwards between add heavy chunks while the backwards let light ones go. Each
    backward of torch's order after the first two, of a stage done before, is covered by one
    priced of its stage's kind: every stage it has done, and as much (weighted) in flight or
    more."""
    weights = (weights * v)[:v]
    layout = Layout(pipeline=p, virtual_stages=v, data_shard=1)
    last = p * v - 1

    def kind(stage):
        return weights[stage // p], stage == 0, stage == last

    for rank in range(p):
        moments = backward_moments(rank, layout, "interleaved_1f1b", m, weights)
        priced = [(kind(at.stage), frozenset(at.done), sum(map(float.__mul__, weights, at.by_stage))) for at in moments]
        in_flight, done, backwards = [], set(), 0
        for action, stage, _mb in pipeline_actions(rank, p, v, m, "interleaved_1f1b"):
            if action == "F":
                in_flight.append(stage)
                continue
            if backwards >= 2 and stage in done and len(done) < v:
                held = sum(weights[x] * in_flight.count(rank + x * p) for x in range(v))
                assert any(k == kind(stage) and d >= done and h >= held for k, d, h in priced), (
                    rank,
                    stage,
                    sorted(done),
                    held,
                )
            backwards += 1
            in_flight.remove(stage)
            done.add(stage)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 2, 8), (4, 2, 16), (4, 5, 16), (3, 2, 12)])
def test_forward_moments_follow_torchs_order(p, v, m):
    """Each forward the estimate prices runs in torch's order, after its stage's first backward
    or as the last forward before the rank's first backward, with the chunks in flight (its own
    included) it says; with every stage's chunks alike, every such forward of torch's is covered
    by one priced of its kind (the first, the last, the others): as many chunks in flight or
    more, and every stage it has done backwards for."""
    layout = Layout(pipeline=p, virtual_stages=v, data_shard=1)

    def kind(stage):
        return (stage == 0, stage == p * v - 1)

    for rank in range(p):
        in_flight, done, seen, latest = [], set(), [], None
        for action, stage, _mb in pipeline_actions(rank, p, v, m, "interleaved_1f1b"):
            if action == "B":
                if not done:
                    seen.append(latest)  # the last forward before the first backward
                in_flight.remove(stage)
                done.add(stage)
                continue
            in_flight.append(stage)
            latest = (stage, tuple(in_flight.count(rank + x * p) for x in range(v)), frozenset(done))
            if stage in done:
                seen.append(latest)
        forwards = forward_moments(rank, layout, "interleaved_1f1b", m)
        assert {kind(at.stage) for at in forwards} <= {kind(stage) for stage, _, _ in seen}
        for at in forwards:
            assert (at.stage, at.by_stage, frozenset(at.done)) in seen, (rank, at)
        for stage, counts, stages_done in seen:
            assert any(
                kind(at.stage) == kind(stage) and at.in_flight >= sum(counts) and stages_done <= set(at.done)
                for at in forwards
            ), (rank, stage, counts, stages_done)
