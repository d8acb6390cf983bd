"""Pipeline schedules: how many micro-batches a rank holds at once, read from torch's code.

Layers split into p*v contiguous stages (`launcher.contract.layout.stage_layer_counts`: balanced,
the end stages a layer lighter, or the recipe's pipeline_layers); pipeline rank r holds stages
r, r+p, ..., r+(v-1)p (torch.distributed.pipelining's interleaved placement; `rank_stages`).
Stage 0 has the embedding; the last stage, which rank p-1 holds, has the final norm and the
output layer. A "chunk" is one stage of one micro-batch: about 1/v of a rank's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

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
    if p == 1:
        return FirstBackward(1, m > 1)
    if schedule == "gpipe":
        return FirstBackward(m, False)
    if schedule == "interleaved_1f1b" and v > 1:
        rounds = max(1, m // p)
        per_round = m // rounds
        warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
        steady_ops = m * v - warmup
        return FirstBackward(warmup + (steady_ops > 0), steady_ops > 1)
    warmup = min(m, p - rank)
    return FirstBackward(warmup, m > warmup)


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


@dataclass(frozen=True, slots=True)
class BackwardMoment:
    """A backward of one of the rank's chunks, where the rank's memory can peak."""

    name: str
    stage: int
    in_flight: int
    """Chunks whose forward has run and whose backward has not finished, this one included."""
    outputs: int
    """Of those, the chunks whose stage sends its output on (not the last stage): the runtime
    keeps each chunk's output (the stage's fwd_cache) for its backward."""
    done: tuple[int, ...]
    """The rank's stages that finished a backward before this one: their gradients have
    accumulated (unsharded, FSDP's sync is off until the step's end)."""
    sent_gradients: int = 0
    """Input gradients the rank sent back before this backward under the interleaved schedule:
    gloo reports such a send complete only when it is waited for, at the step's end, so a CPU
    rank keeps each until then (entrypoints/parallel/pipeline.py, _SendsInFlight)."""
    by_stage: tuple[int, ...] = field(default=(), compare=False)
    """`in_flight` split over the rank's stages, rank, rank + p, ... in order: stages may hold
    different layer counts (none at all at the ends, `stage_layer_counts`)."""


@cache
def backward_moments(rank: int, layout: Layout, schedule: str, microbatches: int) -> tuple[BackwardMoment, ...]:
    """The first and second backward of the rank and, under the interleaved schedule, the second
    backward of its first stage: by then every one of its stages has accumulated gradients while
    as many chunks are in flight as in the steady state (Llama 3 70B, 32K, PP 4 x 2 with 16
    micro-batches peaks there, 6% above the second backward: tests/estimate/traced_configs.py).
    On the rank that holds the loss, also the loss stage's first backward after every one of its
    stages holds gradients: the output weight's gradient beside all of them.

    The interleaved order is torch's (`_get_1f1b_rank_ops`): the warmup's forwards, then a
    forward and a backward per step, then the cooldown's backwards; the k-th forward runs virtual
    stage (k // per_round) % v, the j-th backward virtual stage v - 1 - (j // per_round) % v."""
    p, v, m = layout.pipeline, layout.virtual_stages, microbatches
    last = layout.num_stages - 1
    found = first_backward(rank, layout, schedule, m)
    if not (p > 1 and schedule == "interleaved_1f1b" and v > 1):

        def sends(chunks: int) -> int:
            return 0 if rank == last else chunks

        moments = [
            BackwardMoment(
                "first backward", rank, found.forwards, sends(found.forwards), (), by_stage=(found.forwards,)
            )
        ]
        if m > 1:
            chunks = found.forwards - (not found.steady)
            moments.append(BackwardMoment("second backward", rank, chunks, sends(chunks), (rank,), by_stage=(chunks,)))
        return tuple(moments)
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady_ops = m * v - warmup
    in_flight, done, forwards, moments, sent = [0] * v, [], 0, [], 0
    holds_loss, loss_seen, steady_seen = last % p == rank, False, False
    for j in range(m * v):
        for k in range(forwards, warmup + min(j + 1, steady_ops)):
            in_flight[(k // per_round) % v] += 1
        forwards = max(forwards, warmup + min(j + 1, steady_ops))
        virtual = v - 1 - (j // per_round) % v
        name = {0: "first backward", 1: "second backward"}.get(j)
        if name is None and virtual == 0 and 0 in done and not steady_seen:
            name = "steady backward"  # the steady state's, once every stage holds gradients
        elif name is None and virtual * p + rank == last and len(set(done)) == v and not loss_seen:
            # The loss stage's backward once every stage of the last rank holds gradients: its
            # output weight's and every layer's (traced at Qwen3-30B-A3B pp 2 x 2, rank 1).
            name, loss_seen = "steady loss backward", True
        if name is not None:
            outputs = sum(count for x, count in enumerate(in_flight) if x * p + rank != last)
            stages = tuple(sorted(x * p + rank for x in set(done)))
            moments.append(
                BackwardMoment(name, virtual * p + rank, sum(in_flight), outputs, stages, sent, tuple(in_flight))
            )
            steady_seen = steady_seen or name == "steady backward"
            if steady_seen and (loss_seen or not holds_loss):
                break
        in_flight[virtual] -= 1
        done.append(virtual)
        sent += virtual * p + rank > 0  # stage 0 sends no gradient back
    return tuple(moments)
