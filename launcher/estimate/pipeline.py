"""Pipeline schedules: how many micro-batches a rank holds at once, read from torch's code.

Layers split into p*v contiguous stages (`launcher.contract.layout.stage_layer_counts`: balanced,
the end stages a layer lighter, or the recipe's pipeline_layers); pipeline rank r holds stages
r, r+p, ..., r+(v-1)p (torch.distributed.pipelining's interleaved placement; `rank_stages`).
Stage 0 has the embedding; the last stage, which rank p-1 holds, has the final norm and the
output layer. A "chunk" is one stage of one micro-batch: about 1/v of a rank's layers.
"""

from __future__ import annotations

import dataclasses
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
    """A backward (or, from `forward_moments`, a forward) of one of the rank's chunks, where the
    rank's memory can peak."""

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
    resharded: tuple[int, ...] = ()
    """The rank's other stages whose latest action was a backward. Under sync_each FSDP reshards
    a stage's blocks after each backward and gathers them again at its next forward
    (entrypoints/parallel/pipeline.py, _GradientSyncEachMicroBatch), so these hold no gathered
    weights now; under the other modes every block stays gathered."""
    own_resharded: bool = False
    """A backward right after another of its own stage, no forward between (GPipe, 1F1B's
    cooldown, interleaved runs of one stage): under sync_each that stage's blocks were resharded
    after the last one and are gathered again one at a time as this backward reaches them, with
    the block below prefetched (entrypoints/parallel/fsdp.py `chunk_backward_prefetch`)."""


@cache
def backward_moments(
    rank: int, layout: Layout, schedule: str, microbatches: int, weights: tuple[float, ...] | None = None
) -> tuple[BackwardMoment, ...]:
    """The first and second backward of the rank and, under the interleaved schedule, a steady
    backward per kind of stage (`_heaviest_per_kind`): one run once every stage of the rank holds
    gradients, with the most activations in flight (`weights`: what one chunk of each of the
    rank's stages keeps, rank, rank + p, ... in order; equal if not given). By then every stage has accumulated gradients
    while as many chunks are in flight as in the steady state: Llama 3 70B, 32K, PP 4 x 2 with 16
    micro-batches peaks at stage 0's, 6% above the second backward (tests/estimate/
    traced_configs.py); 70B at 16K, CP 2, PP 2 x 2 with 8 micro-batches at stage 2's, whose
    second round holds one chunk of stage 2 and four of stage 0 beside stage 0's gradients (14%
    above the second backward, which holds as many chunks without them). On the rank that holds
    the loss, the loss stage's is named so: the output weight's gradient beside all of them.

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
            # With no steady phase the second backward follows the first at once (GPipe always).
            # The chunk whose backward just ended counts among the outputs too, as in
            # forward_moments: its send may still hold its output (fsdp._outputs_kept: the latest
            # two). Where no forward ran in between (GPipe, or 1F1B without a steady phase) it is
            # one of the latest two sends. Traced: 8B 16K, TP 2, PP 2 GPipe, rank 0: one boundary
            # tensor that the estimate had let go.
            moments.append(
                BackwardMoment(
                    "second backward",
                    rank,
                    chunks,
                    sends(chunks + 1),
                    (rank,),
                    by_stage=(chunks,),
                    own_resharded=not found.steady,
                )
            )
        return tuple(moments)
    first_two = _interleaved_candidates(rank, p, v, m)[0]
    weights = weights or (1.0,) * v
    pattern = _pattern(weights)
    return (
        *first_two,
        *_uncovered_stage_firsts(rank, p, v, m, pattern),
        *_heaviest_before_all_done(rank, layout, m, weights),
        *_heaviest_per_kind(rank, layout, m, weights),
    )


@cache
def forward_moments(
    rank: int, layout: Layout, schedule: str, microbatches: int, weights: tuple[float, ...] | None = None
) -> tuple[BackwardMoment, ...]:
    """The forwards where the rank can peak: the last forward before its first backward, and per
    kind of stage a forward after that stage's first backward, with the most activations in
    flight (`weights` as for backward_moments). `in_flight` counts the chunk in forward; after a
    backward `outputs` counts it too, standing for the output of the chunk whose backward just
    ended, which its send may still hold (fsdp._outputs_kept: the latest two). Under sync_each
    FSDP reshards each block after its backward, so such a forward all-gathers the stage's blocks
    again. The last forward before the first backward holds as many chunks as that backward,
    with no gradients yet; a steady forward covers it where there is one, but GPipe and a
    1F1B rank without a steady phase have none. Traced: 8B 16K, TP 8, PP 4 GPipe, selective,
    rank 0 peaks in its fourth forward, 3.4% under the trace while it was not priced."""
    p, v, m = layout.pipeline, layout.virtual_stages, microbatches
    last = layout.num_stages - 1
    if p == 1:
        return ()
    if not (schedule == "interleaved_1f1b" and v > 1):
        found = first_backward(rank, layout, schedule, m)
        chunks = found.forwards  # one chunk fewer after the backward, one more in forward
        if not found.steady:
            outputs = 0 if rank == last else chunks - 1  # the chunks before it
            return (BackwardMoment("last warmup forward", rank, chunks, outputs, (), by_stage=(chunks,)),)
        outputs = 0 if rank == last else chunks  # the chunks before it, and the one just done
        return (BackwardMoment("steady forward", rank, chunks, outputs, (rank,), by_stage=(chunks,)),)
    pattern = _pattern(weights or (1.0,) * v)
    found = [moment for front in _fronts(rank, p, v, m, pattern, False) for moment in front]
    # A stage may run more than one forward that no other covers (more chunks in flight, or
    # more stages done): each is priced, named by the stages done.
    stages = [moment.stage for moment in found]
    return tuple(
        dataclasses.replace(moment, name=f"{moment.name}, {_count(len(moment.done), 'stage')} done")
        if stages.count(moment.stage) > 1
        else moment
        for moment in found
    )


def _heaviest_per_kind(rank: int, layout: Layout, m: int, weights: tuple[float, ...] | None):
    """Of an interleaved rank's steady backwards, the one holding the most (`weights` per stage of
    the rank) per kind of stage: stages whose chunks keep as much, and which are not the first or
    the last, run the same backward and need pricing once (forwards: forward_moments). The
    weights change with every workload and the candidates only with the schedule, so the search
    runs over the few candidates `_fronts` leaves."""
    p, v = layout.pipeline, layout.virtual_stages
    weights = weights or (1.0,) * v
    pattern = _pattern(weights)
    found = [max(front, key=lambda moment: _holds(moment, weights)) for front in _fronts(rank, p, v, m, pattern, True)]
    return sorted(found, key=lambda moment: -moment.stage)


def _holds(moment: BackwardMoment, weights: tuple[float, ...]) -> tuple:
    """What a moment holds, to pick the heaviest of alike ones: its chunks in flight weighed by
    what each stage's keep, then, of as heavy ones, the fewest stages resharded (under sync_each
    those hold no gathered blocks). Traced: 70B 4K, TP 2, PP 4 x 2, sync_each: 8.3% under the
    trace where a steady backward after one of its own stage stood for one after another stage's."""
    activations = sum(weights[x] * count for x, count in enumerate(moment.by_stage))
    return activations, -len(moment.resharded), not moment.own_resharded


def _heaviest_before_all_done(rank: int, layout: Layout, m: int, weights: tuple[float, ...] | None) -> tuple:
    """Of an interleaved rank's backwards after the first two, of stages done before, while some
    other stage has yet to run one, the one holding the most (`weights`) per kind of stage and
    set of stages done: as many gradients, and the forwards between them may add chunks heavier
    than the backwards let go. Traced: 70B 32K, CP 2, PP 4 x 2, selective (one layer a stage:
    stage 1 kept, stage 5 checkpointed), sync_each, rank 1 peaks in stage 5's fourth backward,
    with all eight of stage 1's chunks in flight: 2.5% under the trace, whose second backward
    held two of them fewer."""
    p, v = layout.pipeline, layout.virtual_stages
    weights = weights or (1.0,) * v
    pattern, last = _pattern(weights), p * v - 1

    heaviest: dict[tuple, BackwardMoment] = {}
    for moment in _uncovered_before_all_done(rank, p, v, m, pattern):
        key = _kind(moment, pattern, p, last), moment.done, moment.own_resharded
        if key not in heaviest or _holds(moment, weights) > _holds(heaviest[key], weights):
            heaviest[key] = moment
    # Named by the stages done, and, where two differ only in that, by the latest action.
    found = [
        dataclasses.replace(moment, name=f"backward, stage {moment.stage}, {_count(len(moment.done), 'stage')} done")
        for moment in heaviest.values()
    ]
    names = [moment.name for moment in found]
    return tuple(
        dataclasses.replace(moment, name=f"{moment.name}, after its own")
        if names.count(moment.name) > 1 and moment.own_resharded
        else moment
        for moment in found
    )


@cache
def _uncovered_before_all_done(rank: int, p: int, v: int, m: int, pattern: tuple[int, ...]) -> tuple:
    """The backwards `_heaviest_before_all_done` weighs: of those before every stage is done, the
    ones no steady backward or other such backward of the same kind covers (with every stage's
    chunks alike, the steady state's cover them all)."""
    return _uncovered(_interleaved_candidates(rank, p, v, m)[4], rank, p, v, m, pattern)


def _pattern(weights: tuple[float, ...]) -> tuple[int, ...]:
    """Which of the rank's stages keep as much per chunk: each stage's index among the distinct
    weights, in order of first appearance."""
    first_seen = list(dict.fromkeys(weights))
    return tuple(first_seen.index(weight) for weight in weights)


def _summary(moment: BackwardMoment, pattern: tuple[int, ...]) -> tuple:
    """What `_fronts` compares of a moment: chunks in flight per kind of stage, the stages done,
    the other stages resharded, and whether its own is."""
    counts = [0] * (max(pattern) + 1)
    for x, count in enumerate(moment.by_stage):
        counts[pattern[x]] += count
    return tuple(counts), set(moment.done), moment, set(moment.resharded), moment.own_resharded


def _covers(a: tuple, b: tuple) -> bool:
    """Whether moment summary `a` holds at least what `b` does, whatever the chunks weigh: as many
    chunks of every kind or more, every stage `b` has done, and no stage resharded that `b` keeps."""
    return b[1] <= a[1] and a[3] <= b[3] and a[4] <= b[4] and all(map(int.__ge__, a[0], b[0]))


def _kind(moment: BackwardMoment, pattern: tuple[int, ...], p: int, last: int) -> tuple:
    return pattern[moment.stage // p], moment.stage == 0, moment.stage == last


@cache
def _uncovered_stage_firsts(rank: int, p: int, v: int, m: int, pattern: tuple[int, ...]) -> tuple:
    """The stages' first backwards (`_interleaved_candidates`) that no other first backward or
    steady backward of the same kind covers: stages alike run alike first backwards, and a
    stage's first backward may hold no more than a later one, which has more stages done."""
    return _uncovered(_interleaved_candidates(rank, p, v, m)[3], rank, p, v, m, pattern)


def _uncovered(candidates: tuple, rank: int, p: int, v: int, m: int, pattern: tuple[int, ...]) -> tuple:
    """Of `candidates`, those no steady backward or other candidate of the same kind covers,
    whatever the chunks weigh; of candidates alike in every respect compared, one stands for all."""
    last = p * v - 1
    alike: dict[tuple, tuple] = {}
    for moment in candidates:
        summary = _summary(moment, pattern)
        alike[_kind(moment, pattern, p, last), summary[0], moment.done, moment.resharded, moment.own_resharded] = (
            summary
        )
    by_kind: dict[tuple, list] = {}
    for moment in _interleaved_candidates(rank, p, v, m)[1]:
        by_kind.setdefault(_kind(moment, pattern, p, last), []).append(_summary(moment, pattern))
    for (kind, *_), summary in alike.items():
        by_kind.setdefault(kind, []).append(summary)
    return tuple(
        b[2] for (kind, *_), b in alike.items() if not any(a is not b and _covers(a, b) for a in by_kind[kind])
    )


@cache
def _fronts(rank: int, p: int, v: int, m: int, pattern: tuple[int, ...], backwards: bool) -> tuple[tuple, ...]:
    """The candidates per kind of stage (`pattern`: which of the rank's stages keep as much per
    chunk) that no other of the same kind covers: as many chunks or more of every weight and the
    stages done. Only these can hold the most, whatever the weights."""
    last = p * v - 1
    candidates = _interleaved_candidates(rank, p, v, m)[1 if backwards else 2]
    by_kind: dict[tuple, dict] = {}
    for moment in candidates:
        summary = _summary(moment, pattern)
        # Of candidates alike in these respects, the latest stands for all: it has sent back the
        # most input gradients, which only a CPU rank (gloo) still holds.
        key = summary[0], moment.done, moment.resharded, moment.own_resharded
        by_kind.setdefault(_kind(moment, pattern, p, last), {})[key] = summary

    return tuple(
        tuple(b[2] for b in items if not any(a is not b and _covers(a, b) for a in items))
        for items in (list(alike.values()) for alike in by_kind.values())
    )


@cache
def _interleaved_candidates(rank: int, p: int, v: int, m: int) -> tuple[tuple, tuple, tuple, tuple, tuple]:
    """An interleaved rank's moments that can hold the most, whatever its chunks weigh: its first
    two backwards; the backwards once every stage holds gradients; the forwards of a stage after
    its first backward (each distinct one once), and the warmup's last forward (as many chunks
    in flight as the first backward, without its gradients); and each other stage's first
    backward, where that stage's gradients are new beside as many chunks in flight as the steady
    state's or more (traced: 70B 4K, PP 4 x 2, 8 micro-batches, rank 0's first backward of stage
    0 after four of stage 4: 3.4% under the trace while only the steady backwards were
    priced); last, the other backwards before every stage holds gradients
    (`_heaviest_before_all_done`)."""
    last = p * v - 1
    first_two, steady, forwards, stage_firsts, before_all_done = [], {}, {}, [], []
    warmup_last = None  # the latest forward before the first backward
    for kind, virtual, in_flight, done, sent, resharded, own_resharded in _interleaved_ops(rank, p, v, m):
        stage = virtual * p + rank
        outputs = sum(count for x, count in enumerate(in_flight) if x * p + rank != last)
        stages = tuple(x * p + rank for x in done)
        moment = BackwardMoment(
            _moment_name(kind, stage, len(first_two), p, last),
            stage,
            sum(in_flight),
            outputs,
            stages,
            sent,
            in_flight,
            tuple(x * p + rank for x in resharded),
            own_resharded,
        )
        if kind == "F":
            if virtual in done:
                forwards.setdefault((moment, in_flight), moment)
            elif not first_two:
                warmup_last = dataclasses.replace(moment, name=f"last warmup forward, stage {stage}")
        elif len(first_two) < 2:
            if not first_two:
                forwards.setdefault((warmup_last, warmup_last.by_stage), warmup_last)
            first_two.append(moment)
        elif virtual not in done:
            stage_firsts.append(dataclasses.replace(moment, name=f"first backward, stage {stage}"))
        elif len(done) == v:
            steady.setdefault((moment, in_flight), moment)  # by_stage is left out of equality
        else:
            before_all_done.append(moment)
    return (
        tuple(first_two),
        tuple(steady.values()),
        tuple(forwards.values()),
        tuple(stage_firsts),
        tuple(before_all_done),
    )


def _moment_name(kind: str, stage: int, backwards_before: int, p: int, last: int) -> str:
    if kind == "F":
        return f"steady forward, stage {stage}"
    if backwards_before < 2:
        return ("first backward", "second backward")[backwards_before]
    if stage == last:
        return "steady loss backward"
    return "steady backward" if stage < p else f"steady backward, stage {stage}"


def _interleaved_ops(rank: int, p: int, v: int, m: int):
    """The actions of an interleaved rank in torch's order (`_get_1f1b_rank_ops`: the warmup's
    forwards, then a forward and a backward per step, then the cooldown's backwards; the k-th
    forward runs virtual stage (k // per_round) % v, the j-th backward virtual stage
    v - 1 - (j // per_round) % v), as (F or B, its virtual stage, the chunks in flight per
    virtual stage, a forward's own included, the virtual stages of the backwards before it, the
    input gradients sent back before it, the other virtual stages whose latest action was a
    backward, and for a backward whether its own stage's was). They end one round (v x per_round backwards) after
    the first backward with every stage done: the steady state repeats each round from there,
    and the cooldown only lets chunks go, so no later action holds more."""
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady_ops = m * v - warmup
    in_flight, done, sent, stop = [0] * v, set(), 0, None
    backward_last = set()  # the virtual stages whose latest action was a backward

    def resharded(virtual):
        return tuple(sorted(backward_last - {virtual}))

    def forward(k):
        virtual = (k // per_round) % v
        in_flight[virtual] += 1
        backward_last.discard(virtual)
        return "F", virtual, tuple(in_flight), tuple(sorted(done)), sent, resharded(virtual), False

    for k in range(warmup):
        yield forward(k)
    for j in range(m * v):
        if j < steady_ops:
            yield forward(warmup + j)
        virtual = v - 1 - (j // per_round) % v
        own = virtual in backward_last
        yield "B", virtual, tuple(in_flight), tuple(sorted(done)), sent, resharded(virtual), own
        in_flight[virtual] -= 1
        done.add(virtual)
        backward_last.add(virtual)
        sent += virtual * p + rank > 0  # stage 0 sends no gradient back
        if stop is None and len(done) == v:
            stop = j + v * per_round
        if stop is not None and j >= stop:
            return


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
