"""The parallel layout and every rule it must satisfy: plain integers, standard library only.

A layout splits `world_size` GPUs into a 5-D mesh, outermost first:
pp (pipeline) x dp_replicate (HSDP replicas) x dp_shard (FSDP) x cp (context) x tp (tensor).
TP is innermost so it stays on NVLink inside a node; CP next, because its K/V all-gathers are
the next most frequent collective. The entrypoints build their DeviceMesh in this same order.

Expert parallelism (`expert`, ep) adds no GPUs: it borrows its ranks from dp_shard x cp x tp,
as torchtitan's `ParallelDims` does with expert tensor parallelism off (etp = 1,
torchtitan/distributed/parallel_dims.py: "EP would borrow all cp and tp and some dp_shard
degree") and Megatron-Core with expert_tensor_parallel_size 1. A mixture-of-experts layer runs
on the rank's own slice of the sequence, so every rank of dp_shard x cp x tp holds different
tokens there (`moe_ranks`). Those ranks, flattened with tp innermost, are cut into groups of ep
consecutive ranks; each group holds every expert once (num_experts / ep per rank) and trades
tokens by all-to-all, and FSDP shards the experts over the dp_shard x cp x tp / ep groups
(`expert_fsdp`). The MoE layers' router and shared experts and every other layer keep the 5-D
mesh.

The launcher (recipe validation, the planner, the estimator) and the entrypoints (the resolved
config, the pipeline split) both read the rules here, so a layout one side accepts is one the
other runs. Rules return `LayoutProblem(path, message)`: a recipe key path and one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cache
from typing import NamedTuple, Protocol

from launcher.contract.text import choices

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    data_replicate: int = 1
    data_shard: int = 1
    expert: int = 1
    """Expert-parallel degree: ranks of dp_shard x cp x tp that split each MoE layer's experts
    (1: every rank holds all experts). Not a factor of world_size."""
    virtual_stages: int = 1
    pipeline_layers: tuple[int, ...] | None = None
    """Layers per pipeline stage (pipeline x virtual_stages of them), or None for the balanced
    split of `stage_layer_counts`."""

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data_replicate * self.data_shard * self.context * self.tensor

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: HSDP replicas times FSDP shards."""
        return self.data_replicate * self.data_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks that shard parameters, gradients and optimizer states: dp_shard x cp."""
        return self.data_shard * self.context

    @property
    def moe_ranks(self) -> int:
        """Ranks that hold different tokens in a mixture-of-experts layer: dp_shard x cp x tp (tp
        ranks route their own slices of the sequence), the ranks expert parallelism borrows."""
        return self.fsdp_shard * self.tensor

    @property
    def expert_fsdp(self) -> int:
        """Ranks that shard each expert-parallel rank's experts: dp_shard x cp x tp / expert."""
        return self.moe_ranks // self.expert

    @property
    def experts_apart(self) -> bool:
        """Whether a MoE layer's experts are an FSDP unit of their own, on the expert mesh: under
        expert parallelism, or under TP, whose ranks compute the experts on different tokens."""
        return self.expert > 1 or self.tensor > 1

    @property
    def num_stages(self) -> int:
        return self.pipeline * self.virtual_stages

    def mesh_shape(self) -> dict[str, int]:
        return dict(
            zip(
                MESH_DIMS,
                (self.pipeline, self.data_replicate, self.data_shard, self.context, self.tensor),
                strict=True,
            )
        )

    def as_dict(self) -> dict[str, int | list[int]]:
        """The six degrees, expert when above 1, and pipeline_layers when set (subclasses such
        as the entrypoints' ParallelConfig add more fields). Dense layouts read back unchanged."""
        found = {f.name: getattr(self, f.name) for f in fields(Layout) if f.name not in _WRITTEN_WHEN_SET}
        if self.expert > 1:
            found["expert"] = self.expert
        if self.pipeline_layers is not None:
            found["pipeline_layers"] = list(self.pipeline_layers)
        return found

    def __str__(self) -> str:
        parts = [f"{name}{size}" for name, size in self.mesh_shape().items() if size > 1]
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.expert > 1:
            parts.append(f"ep{self.expert}")
        return "x".join(parts) or "single"


_WRITTEN_WHEN_SET = ("pipeline_layers", "expert")


def fill_data_shard(*, world_size: int, tensor: int, context: int, pipeline: int, data_replicate: int) -> int | None:
    """The data_shard that makes the product equal world_size, or None if none does."""
    others = tensor * context * pipeline * data_replicate
    if others > world_size or world_size % others:
        return None
    return world_size // others


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, built from its prime factors.

    Trial division stops at the square root, so a prime near 10^9 costs ~16,000 steps where the
    scan of 1..n it replaces took minutes (and `plan --gpus 10**30` forever). The recipe schema
    and the planner bound every count that reaches here (GPUs, layers, batch sizes).
    """
    if n < 1:
        return []
    powers: dict[int, int] = {}
    rest, factor = n, 2
    while factor * factor <= rest:
        while rest % factor == 0:
            powers[factor] = powers.get(factor, 0) + 1
            rest //= factor
        factor += 1 if factor == 2 else 2
    if rest > 1:
        powers[rest] = powers.get(rest, 0) + 1
    found = [1]
    for prime, power in powers.items():
        found = [d * prime**k for d in found for k in range(power + 1)]
    return sorted(found)


# --- the sequence and the pipeline split ---------------------------------------------------------


MAX_SEQ_LEN = 2**22
"""The longest training.seq_len a recipe may ask for (the schema's bound; no hint goes past it):
4M tokens, four times the 1M that published context-parallel runs reach (NeMo's long-sequence
table, docs/source/performance/performance_long_sequence.md, goes to 1024K)."""


def seq_len_divisor(context: int, tensor: int) -> int:
    """What seq_len must be a multiple of: zigzag context parallelism cuts the sequence into
    2 x context chunks, and sequence parallelism splits each rank's tokens over the tensor group."""
    return 2 * context * tensor if context > 1 else tensor


EMBEDDING_WEIGHT = 1
"""The embedding counted as this many transformer layers when stages are balanced: its lookup
costs nothing, but its V x h weight, fp32 master and AdamW states are about 2/3 of a Llama 3.1
405B block's."""
OUTPUT_WEIGHT = 1
"""The final norm, output layer and loss counted as this many layers: the fused loss recomputes
the logits in backward, 8 FLOPs per output weight and token against a block's 6 per weight,
about 0.9 of a 405B block (torchtitan's `input_weight`/`output_weight` default to 1 too)."""


def stage_layer_counts(num_layers: int, num_stages: int, override: Sequence[int] | None = None) -> list[int]:
    """How many transformer layers each of the `num_stages` pipeline stages holds, in order.

    `override` (the recipe's `parallel.pipeline_layers`) is used as given. Otherwise the stages
    are balanced as torchtitan's `generate_llm_fqn_per_model_part` does: the first stage also
    carries the embedding and the last the output layer and loss, each counted as one layer
    (EMBEDDING_WEIGHT, OUTPUT_WEIGHT). The rule:

    1. the heaviest stage's cost (layers + what it carries) is made as small as it can be:
       T = ceil((num_layers + embedding + output) / num_stages);
    2. each stage may hold T minus what it carries; while that totals more than num_layers, the
       stage with the most layers gives one up, the earliest first, so layers stay as even as
       T allows and the later stages keep the extras: the first pipeline rank holds the most
       micro-batches in flight under 1F1B.

    126 layers on 8 stages: 15 | 16 x 6 | 15. Layers that divide evenly stay even (32 on 8:
    4 x 8), since T is then one more than the even share. Where T is 1, the end stages hold
    only what they carry: 126 layers on 16 x 8 stages are 0 | 1 x 126 | 0, the split the Llama 3
    paper describes for its 405B ("the first model chunk on the first stage has only the
    embedding, and the last model chunk on the last stage has only output projection and loss
    calculation", arXiv 2407.21783, section 3.3.2). Every other stage holds at least one layer;
    more stages than that allows is a ValueError (the rules refuse it first).
    """
    if override is not None:
        counts = list(override)
        if len(counts) != num_stages or sum(counts) != num_layers or split_problem(counts) is not None:
            raise ValueError(
                f"pipeline_layers {counts} is not {num_stages} layer counts summing to {num_layers}"
                " with a layer on every stage but the end ones"
            )
        return counts
    if num_stages < 1 or num_layers < min_layers(num_stages):
        raise ValueError(
            f"{num_layers} layers cannot fill {num_stages} pipeline stages with a layer on every stage but the end ones"
        )
    return list(_balanced_counts(num_layers, num_stages))


def min_layers(num_stages: int) -> int:
    """The fewest transformer layers `num_stages` stages can split: one on each stage but the
    first and last, which may hold only the embedding and only the output layer and loss."""
    return 1 if num_stages == 1 else num_stages - 2


def split_problem(counts: Sequence[int]) -> str | None:
    """Why an explicit per-stage split is invalid, or None: a stage between the ends holds no
    layer, or a count is negative."""
    if min(counts, default=0) < 0:
        return "has a negative layer count"
    if len(counts) == 1 and counts[0] < 1:
        return "has a stage without layers"
    if min(counts[1:-1], default=1) < 1:
        return "has a middle stage without layers; only the first and last stages may hold none"
    return None


@cache
def _balanced_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    carried = [0] * num_stages
    carried[0] += EMBEDDING_WEIGHT
    carried[-1] += OUTPUT_WEIGHT
    heaviest = -(-(num_layers + EMBEDDING_WEIGHT + OUTPUT_WEIGHT) // num_stages)
    # The end stages may hold none (they carry the embedding and the output); the others need one.
    floors = [1] * num_stages if num_stages == 1 else [0] + [1] * (num_stages - 2) + [0]
    counts = [max(floor, heaviest - c) for floor, c in zip(floors, carried, strict=True)]
    for _ in range(sum(counts) - num_layers):
        counts[counts.index(max(counts))] -= 1
    return tuple(counts)


def stage_layers(num_layers: int, layout: Layout, stage: int) -> range:
    """The layers pipeline stage `stage` (of layout.num_stages) holds: a contiguous run, sized by
    `stage_layer_counts` with the layout's `pipeline_layers` override."""
    start, stop = _stage_bounds(num_layers, layout.num_stages, layout.pipeline_layers)[stage]
    return range(start, stop)


@cache
def _stage_bounds(num_layers: int, num_stages: int, override: tuple[int, ...] | None) -> tuple[tuple[int, int], ...]:
    # Cached like `_layers_by_rank`: the estimator asks for every stage of every rank it counts.
    counts = stage_layer_counts(num_layers, num_stages, override)
    starts = [sum(counts[:stage]) for stage in range(num_stages)]
    return tuple((start, start + count) for start, count in zip(starts, counts, strict=True))


def rank_stages(pp_rank: int, layout: Layout) -> list[int]:
    """The stages pipeline rank `pp_rank` holds: r, r + pp, r + 2·pp, ... (the "loop" placement
    torch.distributed.pipelining's interleaved 1F1B expects); the first holds the embedding, the
    last (on rank pp - 1) the final norm and the output layer."""
    return [pp_rank + v * layout.pipeline for v in range(layout.virtual_stages)]


def layers_by_rank(num_layers: int, layout: Layout) -> list[int]:
    """How many layers each pipeline rank holds over all its stages, rank 0 first."""
    return list(_layers_by_rank(num_layers, layout.pipeline, layout.virtual_stages, layout.pipeline_layers))


@cache
def _layers_by_rank(num_layers: int, pipeline: int, virtual: int, override: tuple[int, ...] | None) -> tuple[int, ...]:
    # Cached: the estimator and the planner ask for every rank of thousands of layouts, and
    # only these four numbers matter.
    counts = stage_layer_counts(num_layers, pipeline * virtual, override)
    return tuple(sum(counts[rank::pipeline]) for rank in range(pipeline))


def checkpointed_layers(mode: str, num_layers: int, layout: Layout) -> frozenset[int]:
    """The layer ids `parallel.activation_checkpointing` wraps (entrypoints/parallel/activation.py):
    every layer under full; under selective every other layer of each pipeline rank, the 2nd,
    4th, ... of the layers it holds over its stages in order (without pipelining, the odd ids).
    Counting per rank, not by global id, keeps half of every rank's layers checkpointed when
    stages hold one layer each: with 126 layers on 16 x 8 stages the odd ids would all fall on
    the even ranks, and the others would keep every activation."""
    if mode == "full":
        return frozenset(range(num_layers))
    if mode != "selective":
        return frozenset()
    return _selective_layers(num_layers, layout.pipeline, layout.virtual_stages, layout.pipeline_layers)


@cache
def _selective_layers(num_layers: int, pipeline: int, virtual: int, override: tuple[int, ...] | None) -> frozenset[int]:
    bounds = _stage_bounds(num_layers, pipeline * virtual, override)
    chosen = []
    for rank in range(pipeline):
        held = [layer for start, stop in bounds[rank::pipeline] for layer in range(start, stop)]
        chosen += held[1::2]
    return frozenset(chosen)


def rank_layers(num_layers: int, layout: Layout, pp_rank: int) -> int:
    """How many layers pipeline rank `pp_rank` holds over all its stages."""
    return layers_by_rank(num_layers, layout)[pp_rank]


# --- the rules ---------------------------------------------------------------------------------------


class LayoutProblem(NamedTuple):
    path: str
    """The recipe key to change, e.g. "parallel.tensor"."""
    message: str


class ExpertShape(Protocol):
    """What the rules read of a model's `moe` block (the catalog's MoeArch, the config's MoeConfig)."""

    num_experts: int
    aux_loss_coef: float
    z_loss_coef: float


class ModelShape(Protocol):
    """What the rules read of a model: the catalog's ModelArch and the entrypoints' ModelConfig."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_embeddings: bool
    moe: ExpertShape | None


def tensor_choices(model: ModelShape, gpus_per_node: int) -> list[int]:
    """TP degrees that split both query and KV heads evenly and stay inside one node."""
    return [t for t in divisors(model.num_kv_heads) if model.num_heads % t == 0 and t <= gpus_per_node]


def layout_problems(
    layout: Layout,
    model: ModelShape,
    *,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    gpus_per_node: int,
    schedule: str,
) -> list[LayoutProblem]:
    """Every rule a parallel layout must satisfy for this model and batch."""
    return [
        *_tensor_problems(layout, model, gpus_per_node),
        *expert_problems(layout, model),
        *_pipeline_problems(layout, model, schedule),
        *_sequence_problems(layout, seq_len),
        *_batch_problems(layout, global_batch_size, micro_batch_size, schedule),
    ]


def _tensor_problems(layout: Layout, model: ModelShape, gpus_per_node: int) -> list[LayoutProblem]:
    t = layout.tensor
    if model.num_heads % t or model.num_kv_heads % t:
        heads = model.num_heads if model.num_heads % t else model.num_kv_heads
        kind = "attention heads" if model.num_heads % t else "KV heads"
        valid = choices(tensor_choices(model, gpus_per_node))
        return [LayoutProblem("parallel.tensor", f"{t} does not divide {heads} {kind}; use {valid}")]
    if t > gpus_per_node:
        valid = choices(tensor_choices(model, gpus_per_node))
        return [
            LayoutProblem(
                "parallel.tensor",
                f"{t} exceeds the {gpus_per_node} GPUs of one node; tensor parallelism needs NVLink, use {valid}",
            )
        ]
    return []


def expert_choices(model: ModelShape, layout: Layout) -> list[int]:
    """The `parallel.expert` degrees this model and layout can run: divisors of the expert count
    that also divide dp_shard x cp x tp (1 alone for a dense model)."""
    if model.moe is None:
        return [1]
    return [e for e in divisors(model.moe.num_experts) if layout.moe_ranks % e == 0]


def expert_problems(layout: Layout, model: ModelShape) -> list[LayoutProblem]:
    """Expert parallelism: every rank of an EP group holds the same number of whole experts, and
    the group is made of dp_shard x cp x tp ranks.

    torchtitan's `ParallelDims._validate` (torchtitan/distributed/parallel_dims.py) asks, with
    etp = 1, `ep % (cp * tp) == 0 and (dp_shard * cp * tp) % ep == 0`, since its mesh splits
    dp_shard into dp_shard_mod_ep x dp_shard_in_ep and puts all of cp and tp inside EP. The
    entrypoints here flatten dp_shard x cp x tp first and cut that into (dp_shard x cp x tp / ep,
    ep) (entrypoints/parallel/expert.py), so any ep dividing dp_shard x cp x tp is a valid
    grouping, an ep smaller than cp x tp included.
    """
    e = layout.expert
    if e == 1:
        return []
    key = "parallel.expert"
    if e < 1:
        return [LayoutProblem(key, f"{e} is not a degree; use {choices(expert_choices(model, layout))}")]
    if model.moe is None:
        return [LayoutProblem(key, f"{e} splits experts, but the model is dense (no moe block); use 1")]
    experts = model.moe.num_experts
    valid = choices(expert_choices(model, layout))
    if experts % e:
        return [LayoutProblem(key, f"{e} does not divide the model's {experts} experts; use {valid}")]
    if layout.moe_ranks % e:
        return [
            LayoutProblem(
                key,
                f"{e} does not divide data_shard {layout.data_shard} x context {layout.context} x tensor "
                f"{layout.tensor} = {layout.moe_ranks}, the ranks expert parallelism borrows; use {valid}",
            )
        ]
    return []


def _pipeline_problems(layout: Layout, model: ModelShape, schedule: str) -> list[LayoutProblem]:
    p, v = layout.pipeline, layout.virtual_stages
    problems = _stage_split_problems(layout, model.num_layers)
    if v > 1 and schedule != "interleaved_1f1b":
        problems.append(
            LayoutProblem(
                "parallel.virtual_stages",
                f"{v} stages per rank need pipeline_schedule: interleaved_1f1b, not {schedule}",
            )
        )
    if schedule == "interleaved_1f1b" and v < 2:
        problems.append(
            LayoutProblem(
                "parallel.pipeline_schedule",
                "interleaved_1f1b needs virtual_stages of 2 or more; set virtual_stages or use 1f1b",
            )
        )
    if v > 1 and p == 1:
        problems.append(
            LayoutProblem(
                "parallel.virtual_stages", f"{v} needs pipeline > 1; virtual stages interleave pipeline ranks"
            )
        )
    if model.tie_embeddings and p > 1:
        # The first stage owns the embedding and the last the output layer; tying them would
        # need a cross-stage gradient all-reduce the entrypoints do not do.
        problems.append(
            LayoutProblem("parallel.pipeline", f"{p} splits a model with tied embeddings over stages; use pipeline: 1")
        )
    moe = model.moe
    if moe is not None and p > 1 and (moe.aux_loss_coef or moe.z_loss_coef):
        # The load-balancing loss pools the routing of every MoE layer (transformers'
        # load_balancing_loss_func, entrypoints/model/moe.py); a stage sees only its own layers.
        problems.append(
            LayoutProblem(
                "parallel.pipeline",
                f"{p} splits the MoE layers whose auxiliary losses pool every layer's routing "
                f"(aux_loss_coef {moe.aux_loss_coef}, z_loss_coef {moe.z_loss_coef}); "
                "use pipeline: 1, or a model with both coefficients 0",
            )
        )
    return problems


def _stage_split_problems(layout: Layout, layers: int) -> list[LayoutProblem]:
    """Every stage but the end ones holds at least one layer; an explicit split covers every
    layer once."""
    p, v, stages = layout.pipeline, layout.virtual_stages, layout.num_stages
    given = layout.pipeline_layers
    if given is None:
        if layers >= min_layers(stages):
            return []
        where = "parallel.pipeline" if v == 1 else "parallel.virtual_stages"
        return [
            LayoutProblem(
                where,
                f"pipeline {p} x virtual_stages {v} = {stages} stages need at least {min_layers(stages)} layers "
                f"(one on every stage but the first and last), the model has {layers}; use at most {layers + 2} stages",
            )
        ]
    key = "parallel.pipeline_layers"
    if len(given) != stages:
        return [
            LayoutProblem(
                key, f"{len(given)} entries for pipeline {p} x virtual_stages {v} = {stages} stages; give {stages}"
            )
        ]
    problem = split_problem(given)
    if problem is not None:
        return [LayoutProblem(key, f"{list(given)} {problem}")]
    if sum(given) != layers:
        return [LayoutProblem(key, f"{list(given)} sums to {sum(given)}, but the model has {layers} layers")]
    return []


def _sequence_problems(layout: Layout, seq_len: int) -> list[LayoutProblem]:
    c, t = layout.context, layout.tensor
    divisor = seq_len_divisor(c, t)
    if seq_len % divisor == 0:
        return []
    why = f"2 x context {c} x tensor {t}" if c > 1 else f"tensor {t} (sequence parallel)"
    lower = seq_len - seq_len % divisor
    hint = " or ".join(str(n) for n in (lower, lower + divisor) if 0 < n <= MAX_SEQ_LEN) or str(divisor)
    return [LayoutProblem("training.seq_len", f"{seq_len} is not divisible by {why} = {divisor}; use e.g. {hint}")]


def _batch_problems(
    layout: Layout, global_batch_size: int, micro_batch_size: int, schedule: str
) -> list[LayoutProblem]:
    p, dp = layout.pipeline, layout.data_parallel
    per_step = micro_batch_size * dp
    key = "training.global_batch_size"
    if global_batch_size % per_step:
        return [
            LayoutProblem(
                key,
                f"{global_batch_size} is not a multiple of micro_batch_size {micro_batch_size} x data-parallel size {dp} = {per_step}; use a multiple of {per_step}",
            )
        ]
    microbatches = global_batch_size // per_step
    if p > 1 and microbatches < p:
        return [
            LayoutProblem(
                key,
                f"{global_batch_size} gives {microbatches} micro-batches per step, fewer than the {p} pipeline stages; use at least {p * per_step}",
            )
        ]
    if p > 1 and schedule == "interleaved_1f1b" and microbatches % p:
        return [
            LayoutProblem(
                key,
                f"interleaved 1F1B needs micro-batches per step ({microbatches}) divisible by pipeline {p}; use a multiple of {p * per_step}",
            )
        ]
    return []


# --- context-parallel attention: all-gather or Ulysses ----------------------------------------------

CP_ATTENTION = ("auto", "allgather", "ulysses")
"""`parallel.cp_attention`: how attention runs when context > 1 (resolved configs carry the last two).

- allgather: every rank all-gathers K and V of the whole sequence and attends its zigzag query
  chunks to them; per layer and rank it moves 2·(c-1)/c·s·kv_dim/t values forward and the same
  again as the dK/dV reduce-scatter backward.
- ulysses: two all-to-alls turn the zigzag sequence shard of every head into the whole sequence
  of heads/c heads, plain causal attention runs on that, and one all-to-all turns the output
  back (and the same three reversed in backward); per layer and rank it moves about
  2·(c-1)/c·s/c·(h + kv_dim)/t values each way. It needs both head counts divisible by t x c.
"""


def ulysses_fits(model: ModelShape, layout: Layout) -> bool:
    """Whether Ulysses can split this model's heads: query and KV heads divisible by tensor x context.

    KV heads are not replicated to make GQA fit: with fewer KV heads than t x c the all-gather
    path moves fewer bytes anyway (see `cp_attention_for`)."""
    split = layout.tensor * layout.context
    return model.num_heads % split == 0 and model.num_kv_heads % split == 0


def cp_attention_for(
    choice: str,
    model: ModelShape,
    layout: Layout,
    *,
    activation_checkpointing: str,
    document_masking: bool,
) -> str:
    """The concrete path ("allgather" or "ulysses") for a recipe's `parallel.cp_attention`.

    auto picks Ulysses when the heads allow it and it moves no more bytes than the all-gather.
    Per layer and pass, Ulysses sends (h + kv)/c per token against one all-gather's kv. The
    all-gather path runs three K/V collectives per layer: the forward gather, the gather again
    in backward (a kept layer regathers, entrypoints/parallel/context.py) or in the recomputed
    forward, and the dK/dV reduce-scatter; document masking keeps a kept layer's K/V gathered,
    two. Ulysses runs its all-to-alls once per pass: forward and backward, and the recomputed
    forward of a checkpointed layer. So Ulysses wins when num_heads + num_kv_heads <=
    context x num_kv_heads x (all-gather collectives / Ulysses passes), averaged over the
    layers: 3/2 with every layer kept, 1 with every layer checkpointed, 6/5 under selective
    (every other layer checkpointed), 1 under document masking. MHA wins from cp 2; Llama 3
    8B's 32/8 from cp 4 with no checkpointing, from cp 8 with full. For GQA with few KV heads
    per rank the gathered K/V are small, and the all-gather stays cheaper. Without context
    parallelism the choice does not matter: allgather.
    """
    if choice != "auto":
        return choice
    c = layout.context
    if c == 1 or not ulysses_fits(model, layout):
        return "allgather"
    kept_share = {"none": 1.0, "selective": 0.5, "full": 0.0}[activation_checkpointing]
    allgather_collectives = kept_share * (2 if document_masking else 3) + (1 - kept_share) * 3
    ulysses_passes = kept_share * 2 + (1 - kept_share) * 3
    wins = (model.num_heads + model.num_kv_heads) * ulysses_passes <= c * model.num_kv_heads * allgather_collectives
    return "ulysses" if wins else "allgather"


def cp_attention_problems(choice: str, model: ModelShape, layout: Layout) -> list[LayoutProblem]:
    """A `parallel.cp_attention` the layout cannot run (ulysses with heads it cannot split)."""
    if choice not in CP_ATTENTION:
        return [LayoutProblem("parallel.cp_attention", f"'{choice}' is not one of {choices(CP_ATTENTION)}")]
    if choice != "ulysses" or layout.context == 1 or ulysses_fits(model, layout):
        return []
    t, c = layout.tensor, layout.context
    return [
        LayoutProblem(
            "parallel.cp_attention",
            f"ulysses needs num_heads {model.num_heads} and num_kv_heads {model.num_kv_heads} divisible by "
            f"tensor {t} x context {c} = {t * c}; use allgather or auto",
        )
    ]
