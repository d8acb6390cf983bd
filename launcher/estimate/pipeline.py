"""Pipeline schedules: how many micro-batches a rank holds at once, read from torch's code.

Layers split into p*v contiguous stages (`launcher.contract.layout.stage_layer_counts`: balanced,
the end stages a layer lighter, or the recipe's pipeline_layers); pipeline rank r holds stages
r, r+p, ..., r+(v-1)p (torch.distributed.pipelining's interleaved placement; `rank_stages`).
Stage 0 has the embedding; the last stage, which rank p-1 holds, has the final norm and the
output layer. A "chunk" is one stage of one micro-batch: about 1/v of a rank's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.contract.layout import Layout


@dataclass(frozen=True, slots=True)
class FirstBackward:
    """A rank's schedule up to its first backward, in chunks.

    `forwards` chunks are in flight when the first backward starts (the most the rank ever
    holds). `steady` says whether a forward follows that backward, so the second backward
    again starts with `forwards` chunks in flight, now beside the gradients the first one
    accumulated; otherwise it starts with one chunk fewer.
    """

    forwards: int
    steady: bool
    stages: tuple[int, ...] = ()
    """The stage of the first backward and, where there is one, of the second."""


def first_backward(rank: int, layout: Layout, schedule: str, microbatches: int) -> FirstBackward:
    """Read from torch.distributed.pipelining.schedules (torch 2.13):

    - GPipe runs every forward before any backward.
    - Schedule1F1B warms up with min(m, p - rank) forwards, then alternates one backward and
      one forward, so the first rank holds p micro-batches.
    - ScheduleInterleaved1F1B warms up with (v-1)*m_round + 2*(p-1-rank) chunk forwards
      (`_get_warmup_ops`, capped at m*v; m_round = m / max(1, m // p)), then runs a forward
      and a backward per step. For rank 0 that is p*v + p - 1 chunks: p*(1 + (p-1)/(p*v)) of
      its layers, Megatron's interleaving factor.
    """
    p, v, m = layout.pipeline, layout.virtual_stages, microbatches
    both = (rank, rank) if m > 1 else (rank,)
    if p == 1:
        return FirstBackward(1, m > 1, both)
    if schedule == "gpipe":
        return FirstBackward(m, False, both)
    if schedule == "interleaved_1f1b" and v > 1:
        rounds = max(1, m // p)
        per_round = m // rounds
        warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
        steady_ops = m * v - warmup
        # Backwards walk the rank's stages from the last, per_round micro-batches each.
        stages = tuple((v - 1 - (n // per_round) % v) * p + rank for n in range(min(2, m * v)))
        return FirstBackward(warmup + (steady_ops > 0), steady_ops > 1, stages)
    warmup = min(m, p - rank)
    return FirstBackward(warmup, m > warmup, both)


def receive_buffers_in_backward(stage: int, layout: Layout) -> int:
    """Receive buffers alive beside a backward of `stage`: its own output gradient's, unless it is
    the last stage. entrypoints/parallel/pipeline.py makes each buffer when its receive is posted
    and drops it after the chunk that consumes it, and the interleaved schedule posts receives
    just before their chunk (defer_pp_recv); a received activation is then the stage's input,
    counted with the activations. Checked against torch's own schedule lowering (_add_send_recv,
    _defer_recv_ops) in tests/estimate/test_pipeline_buffers.py."""
    return int(stage < layout.num_stages - 1)


def in_flight(rank: int, layout: Layout, schedule: str, microbatches: int) -> float:
    """The most micro-batches' activations a rank holds at once, in units of all its layers."""
    return first_backward(rank, layout, schedule, microbatches).forwards / layout.virtual_stages


def sent_outputs_in_backward(rank: int, layout: Layout, schedule: str, microbatches: int, nth: int) -> int:
    """Chunks whose output the rank still holds at its `nth` backward (0 or 1), for stages that
    send one on: the runtime keeps each chunk's output for its backward (the stage's fwd_cache),
    and the last stage's output is a loss. Counted from the order the schedule runs: the k-th
    forward is stage ((k // per_round) % v)·p + rank, the j-th backward stage
    (v - 1 - (j // per_round) % v)·p + rank (first_backward)."""
    p, v, m = layout.pipeline, layout.virtual_stages, microbatches
    last = layout.num_stages - 1
    found = first_backward(rank, layout, schedule, m)
    forwards = found.forwards + (nth if found.steady else 0)
    if p == 1 or not (schedule == "interleaved_1f1b" and v > 1):
        return 0 if rank == last else forwards - nth
    per_round = m // max(1, m // p)
    in_flight = [0] * v
    for k in range(forwards):
        in_flight[(k // per_round) % v] += 1
    for j in range(nth):
        in_flight[v - 1 - (j // per_round) % v] -= 1
    return sum(count for virtual, count in enumerate(in_flight) if virtual * p + rank != last)
