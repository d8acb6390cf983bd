"""Transformer Engine's userbuffers TP overlap (Megatron's tp_comm_overlap), as its configs run it.

Workload.tp_overlap "userbuffers" prices a block's sequence-parallel collectives the way TE overlaps
them, each of the ten overlapped GEMMs by the method and SM count its config names
(Workload.userbuffers picks the config; planner-only, the entrypoints run none of this):

- ring_exchange: the collective moves in t - 1 point-to-point steps beside t GEMM chunks, each step
  beside the chunk before the one that needs it (split_overlap_ag starts on the local shard;
  split_overlap_rs sends each finished chunk while the next one runs and ends on its own). The
  bytes move on the copy engines: initialize_ub passes use_ce True and userbuffers_send then issues
  cudaMemcpyAsync and a one-thread flag kernel, so the GEMM keeps its SMs (all but `num_sm` under
  set_sm_margin). The final sum of the received reduce-scatter chunks is left out.
- pipeline: a reduce-scatter in `splits` chunks, each beside the next chunk's GEMM, by a kernel on
  `num_sm` SMs; under set_sm_margin the GEMM runs on the other SMs throughout, else it shares them
  while the kernel runs. The last chunk's reduce-scatter waits on no GEMM.
- bulk: the whole collective beside the whole GEMM, by a kernel on `num_sm` SMs the GEMM shares.

Sources: TransformerEngine v1.8 (the NeMo 24.07 container's), transformer_engine/pytorch/module/base.py
initialize_ub (the default methods, num_sm 16 and set_sm_margin 0 where a config names none),
transformer_engine/pytorch/csrc/comm_gemm_overlap.h (bulk_overlap, split_overlap_rs,
split_overlap_ag: `_math_sms` is the SM count less num_sm under set_sm_margin) and
csrc/userbuffers/userbuffers.cu (userbuffers_send); the same defaults and copy-engine sends at
d0067d0d (module/base.py, common/comm_gemm_overlap/userbuffers/userbuffers.cu), the TE 2.x that
Megatron-Bridge's containers run; the configs' own files, cited per config.
"""

from __future__ import annotations

from dataclasses import dataclass

HOPPER_SMS = 132
"""Streaming multiprocessors of an H100 SXM5 (and an H200), as the NVIDIA H100 Tensor Core GPU
Architecture whitepaper gives them. The published userbuffers rows ran on DGX H100s."""

METHODS = ("ring_exchange", "pipeline", "bulk")


@dataclass(frozen=True, slots=True)
class Overlap:
    """How TE overlaps one GEMM's collective (a `ub_cfgs` entry)."""

    method: str
    num_sm: int = 16
    sm_margin: bool = False
    splits: int = 4  # pipeline only

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"userbuffers method {self.method!r}: use one of {', '.join(METHODS)}")
        if not 0 < self.num_sm < HOPPER_SMS:
            raise ValueError(f"userbuffers num_sm {self.num_sm}: use 1 to {HOPPER_SMS - 1}")

    def exposed(self, comm: float, gemm: float, t: int) -> float:
        """Seconds the collective (`comm` s on its own) adds to its GEMM (`gemm` s on all SMs),
        over t tensor-parallel ranks: what it leaves exposed, and what the SMs it takes cost."""
        slowed = gemm * HOPPER_SMS / (HOPPER_SMS - self.num_sm) if self.sm_margin else gemm
        margin = slowed - gemm
        if self.method == "ring_exchange":
            return max(0.0, comm - slowed * (t - 1) / t) + margin
        shared = 0.0 if self.sm_margin else min(comm, gemm) * self.num_sm / HOPPER_SMS
        if self.method == "pipeline":
            n = self.splits
            return comm / n + max(0.0, (comm - slowed) * (n - 1) / n) + margin + shared
        return max(0.0, comm - slowed) + margin + shared


RING = Overlap("ring_exchange", num_sm=1)


@dataclass(frozen=True, slots=True)
class UserbuffersConfig:
    """A `ub_cfgs` for one block: the forward GEMMs (qkv and fc1 after an all-gather, proj and fc2
    before a reduce-scatter), the output gradients' all-gathers before proj's and fc2's input
    gradient, and the bulk pairs of backward: the saved input's all-gather beside qkv's and fc1's
    input gradient (dgrad) and that gradient's reduce-scatter beside their weight gradient (wgrad)."""

    source: str
    qkv_fprop: Overlap
    proj_fprop: Overlap
    fc1_fprop: Overlap
    fc2_fprop: Overlap
    proj_dgrad: Overlap
    fc2_dgrad: Overlap
    qkv_dgrad: Overlap
    fc1_dgrad: Overlap
    qkv_wgrad: Overlap
    fc1_wgrad: Overlap


def _config(source: str, forward_reduce_scatters: tuple[Overlap, Overlap], bulk: tuple[int, ...]) -> UserbuffersConfig:
    """A block's config as every H100 config here shapes it: ring exchange for the all-gathers
    before qkv and fc1 and before proj's and fc2's input gradients, `forward_reduce_scatters`
    after proj and fc2, and the four bulk pairs of backward on (qkv_dgrad, qkv_wgrad, fc1_dgrad,
    fc1_wgrad) SMs."""
    proj, fc2 = forward_reduce_scatters
    qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad = (Overlap("bulk", num_sm=n) for n in bulk)
    return UserbuffersConfig(
        source=source,
        qkv_fprop=RING,
        proj_fprop=proj,
        fc1_fprop=RING,
        fc2_fprop=fc2,
        proj_dgrad=RING,
        fc2_dgrad=RING,
        qkv_dgrad=qkv_dgrad,
        fc1_dgrad=fc1_dgrad,
        qkv_wgrad=qkv_wgrad,
        fc1_wgrad=fc1_wgrad,
    )


def _pipelined(proj_sms: int, fc2_sms: int) -> tuple[Overlap, Overlap]:
    """NeMo-Framework-Launcher's forward reduce-scatters: pipelined on SMs held from the GEMM."""
    return Overlap("pipeline", num_sm=proj_sms, sm_margin=True), Overlap("pipeline", num_sm=fc2_sms, sm_margin=True)


# Megatron-Bridge's H100 FP8 forward reduce-scatters: ring exchange, num_sm 1 held from the GEMM.
_HELD_RING = (Overlap("ring_exchange", num_sm=1, sm_margin=True),) * 2
_TE_DEFAULT_PIPELINE = (Overlap("pipeline", num_sm=16),) * 2  # set_sm_margin 0
_NEMO_LAUNCHER = "NVIDIA/NeMo-Framework-Launcher 8325688d (tag 24.07), launcher_scripts/conf/training/tp_overlap/"
_BRIDGE = "NVIDIA-NeMo/Megatron-Bridge 7af9601c (v0.2.0), src/megatron/bridge/training/comm_overlap.py "

USERBUFFERS: dict[str, UserbuffersConfig] = {
    "te_defaults": _config(
        "TransformerEngine v1.8 initialize_ub without ub_cfgs: NeMo's configs that set ub_tp_comm_overlap "
        "and name no tp_overlap file",
        _TE_DEFAULT_PIPELINE,
        (16, 16, 16, 16),
    ),
    "nemo_h6144_tp2_mbs2_seqlen2048": _config(
        _NEMO_LAUNCHER + "ub_cfg_h100_h6144_tp2_mbs2_seqlen2048.yaml", _pipelined(16, 24), (8, 16, 4, 16)
    ),
    "nemo_h8192_tp4_mbs1_seqlen4096": _config(
        _NEMO_LAUNCHER + "ub_cfg_h100_h8192_tp4_mbs1_seqlen4096.yaml", _pipelined(24, 16), (8, 16, 2, 4)
    ),
    "nemo_h8192_tp4_mbs1_seqlen8192": _config(
        _NEMO_LAUNCHER + "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml", _pipelined(24, 16), (4, 24, 2, 4)
    ),
    "bridge_fp8_h100_h8192_tp4_mbs1_seqlen8192": _config(
        _BRIDGE + "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192", _HELD_RING, (4, 24, 2, 4)
    ),
    "bridge_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192": _config(
        _BRIDGE + "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192", _HELD_RING, (2, 24, 2, 2)
    ),
}


def userbuffers_config(name: str) -> UserbuffersConfig:
    """The named config; a ValueError that lists the known ones for any other name."""
    try:
        return USERBUFFERS[name]
    except KeyError:
        raise ValueError(f"userbuffers config {name!r} is not known; use one of {', '.join(USERBUFFERS)}") from None
