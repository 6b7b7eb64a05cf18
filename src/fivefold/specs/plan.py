"""`ParallelPlan`: how a model is split over the GPUs of a cluster, and its validation.

Degrees multiply to the world size: pp * dp_replicate * dp_shard * cp * tp, laid out on the mesh
of `fivefold.specs.geometry` (pp outermost, tp innermost). ZeRO shards over the dp_shard x cp ranks
(those that hold different data or sequence shards); dp_replicate > 1 with dp_shard > 1 and
zero = 3 is HSDP. EP borrows its ranks from dp_shard * cp.
Batch sizes are in sequences: global batch = micro_batch * dp * grad_accum, and with pipelining the
grad_accum micro-batches are the pipeline's micro-batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fivefold.errors import ConfigError, WorldSizeProblem
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.float8 import converts_to_fp8
from fivefold.specs.geometry import (
    CP_KINDS,
    OFFLOAD_KINDS,
    RECOMPUTE_POLICIES,
    SCHEDULES,
    ep_fits,
    expert_span,
    mesh_size,
    moe_token_split,
    schedule_problems,
)
from fivefold.specs.hardware import UNKNOWN_GPU
from fivefold.specs.model import ModelSpec
from fivefold.specs.precision import RECIPES
from fivefold.specs.precision import recipe as precision_recipe

# Memory levers: offload (`geometry.Offload`); "optimizer" keeps the fp32 master weights and the
# optimizer state in host memory and runs the optimizer step on the host CPU (ZeRO-Offload,
# DeepSpeed's offload_optimizer); "all" also keeps the sharded parameters and gradients there
# (FSDP2's CPUOffloadPolicy, DeepSpeed's offload_param), so it needs zero = 3.
# Adam's m and v: fp32, or torchao's block-quantised AdamW8bit / AdamWFp8 (1 byte + scales).
OPTIMIZER_STATES = ("fp32", "8bit", "fp8")
# FP8 compute of the linear layers through torchao's float8 training (dynamic scaling).
FP8_RECIPES = ("none", "tensorwise", "rowwise")
RUNTIME_COMPUTE_DTYPES = ("fp32", "bf16")  # what fivefold's runtime computes in
PLAN_LIMIT = 1 << 17  # the largest degree or micro-batch (cf. spec.cluster.MAX_GPUS)
# Micro-batches per step: the pipeline schedule is simulated (and drawn) micro-batch by
# micro-batch, so this bounds the planner's time and memory (4,096 x 64 stages: ~5 s, 0.6 GB).
PLAN_LIMITS = {"grad_accum": 4096}


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1
    sp: bool = True  # sequence parallel in the TP group (ignored when tp == 1)
    pp: int = 1
    vpp: int = 1  # model chunks (virtual stages) per pipeline rank
    schedule: str = "1f1b"
    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 0
    cp: int = 1
    cp_kind: str = "ring"
    ep: int = 1
    # routed experts split over this many TP ranks: 1 (fivefold's rule, `specs.geometry`) or tp
    # (Megatron's expert tensor parallelism, which other software's published runs use)
    etp: int = 1
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1  # micro-batches per optimizer step (the pipeline's micro-batch count)
    recompute: str = "none"
    precision: str = "bf16-mixed"
    offload: str = "none"  # OFFLOAD_KINDS
    optimizer_states: str = "fp32"  # OPTIMIZER_STATES
    fp8: str = "none"  # FP8_RECIPES: the linear layers' GEMMs in FP8 (torchao float8)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return mesh_size(self)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.dp * self.grad_accum

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vpp

    def with_(self, **changes) -> ParallelPlan:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"TP{self.tp}" + ("+SP" if self.sp and self.tp > 1 else "")]
        pp = f"PP{self.pp}"
        if self.pp > 1:
            pp += f" {self.schedule}" + (f" v={self.vpp}" if self.vpp > 1 else "")
        parts.append(pp)
        dp = f"DP{self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp = f"HSDP{self.dp_replicate}x{self.dp_shard}"
        parts.append(dp + (f" ZeRO-{self.zero}" if self.zero else ""))
        if self.cp > 1:
            parts.append(f"CP{self.cp} {self.cp_kind}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}" + (f" ETP{self.etp}" if self.etp > 1 else ""))
        parts.append(f"mbs {self.micro_batch} x accum {self.grad_accum}")
        parts.append(f"recompute {self.recompute}, {self.precision}")
        if self.fp8 != "none":
            parts.append(f"fp8 {self.fp8}")
        if self.optimizer_states != "fp32":
            parts.append(f"{self.optimizer_states} Adam states")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return ", ".join(parts)

    # ---- validation ------------------------------------------------------------------------
    def problems(
        self,
        model: ModelSpec | None = None,
        cluster: ClusterSpec | None = None,
        *,
        runtime: bool = True,
    ) -> list[str]:
        """Every reason this plan cannot run, each naming the field and the fix.

        This is the one set of rules: the CLI, recipe loading, the search, `--plan auto` and the
        runtime all ask it before any process starts. `runtime=True` (the default everywhere)
        adds what fivefold's own runtime does not implement (`runtime_problems`); only
        estimates of runs made by other software (the published runs the planner is checked
        against) pass False.
        """
        out = self._field_problems()
        if out:
            return out  # every check below reads these fields
        out = self._own_problems()
        if runtime:
            out += self.runtime_problems(model)
        if cluster is not None:
            out += self._cluster_problems(cluster)
        if model is not None:
            out += self._model_problems(model)
        return out

    def validate(
        self,
        model: ModelSpec | None = None,
        cluster: ClusterSpec | None = None,
        *,
        runtime: bool = True,
    ) -> None:
        """Raise one `ConfigError` listing every problem of this plan, the model and the cluster."""
        model_problems = model.problems() if model is not None else []
        cluster_problems = cluster.problems() if cluster is not None else []
        problems = model_problems + cluster_problems
        # The plan's checks against a model or cluster read their fields: only those that are valid.
        problems += self.problems(
            None if model_problems else model,
            None if cluster_problems else cluster,
            runtime=runtime,
        )
        if problems:
            raise ConfigError(problems)

    def _field_problems(self) -> list[str]:
        """Each field alone: its type, range or set of choices."""
        out = []
        for f in (
            "tp",
            "pp",
            "vpp",
            "dp_replicate",
            "dp_shard",
            "cp",
            "ep",
            "etp",
            "micro_batch",
            "grad_accum",
        ):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                out.append(f"plan.{f} = {value!r}: must be a whole number >= 1.")
            elif value > (limit := PLAN_LIMITS.get(f, PLAN_LIMIT)):
                out.append(
                    f"plan.{f} = {value:,} is beyond any layout fivefold plans or runs (at most "
                    f"{limit:,}); check the value."
                )
        if self.zero not in (0, 1, 2, 3):
            out.append(f"plan.zero = {self.zero!r}: ZeRO stage must be 0, 1, 2 or 3.")
        if self.schedule not in SCHEDULES:
            out.append(f"plan.schedule = {self.schedule!r}: choose one of {', '.join(SCHEDULES)}.")
        if self.cp_kind not in CP_KINDS:
            out.append(f"plan.cp_kind = {self.cp_kind!r}: choose one of {', '.join(CP_KINDS)}.")
        if self.recompute not in RECOMPUTE_POLICIES:
            out.append(
                f"plan.recompute = {self.recompute!r}: choose one of "
                f"{', '.join(RECOMPUTE_POLICIES)}."
            )
        if self.precision not in RECIPES:
            out.append(f"plan.precision = {self.precision!r}: choose one of {', '.join(RECIPES)}.")
        for field, choices in (
            ("offload", OFFLOAD_KINDS),
            ("optimizer_states", OPTIMIZER_STATES),
            ("fp8", FP8_RECIPES),
        ):
            if getattr(self, field) not in choices:
                out.append(
                    f"plan.{field} = {getattr(self, field)!r}: choose one of {', '.join(choices)}."
                )
        return out

    def _own_problems(self) -> list[str]:
        """The plan's fields against each other (every field valid alone)."""
        out = []
        if self.offload == "all" and self.zero != 3:
            out.append(
                f"plan.offload = 'all' with plan.zero = {self.zero}: parameters and gradients "
                "live in host memory only as FSDP2 shards; set plan.zero = 3, or offload only "
                "the optimizer (plan.offload = 'optimizer')."
            )
        if self.offload == "optimizer" and self.zero == 3:
            out.append(
                "plan.offload = 'optimizer' with plan.zero = 3: FSDP2 offloads parameters, "
                "gradients and optimizer state together; set plan.offload = 'all', or zero <= 2."
            )
        if self.fp8 != "none" and precision_recipe(self.precision).compute_dtype != "bf16":
            out.append(
                f"plan.fp8 = {self.fp8!r} with plan.precision = {self.precision!r}: FP8 linear "
                "layers run inside a bf16 recipe; use plan.precision = 'bf16-mixed' (or another "
                "bf16 recipe), or plan.fp8 = 'none'."
            )
        if self.optimizer_states != "fp32" and precision_recipe(self.precision).optimizer_bytes < 8:
            out.append(
                f"plan.optimizer_states = {self.optimizer_states!r} with plan.precision = "
                f"{self.precision!r}: that recipe's optimizer bytes already describe a compressed "
                "optimizer (no fp32 m and v to quantise); set plan.optimizer_states = 'fp32', or "
                "use a recipe with fp32 Adam states such as 'bf16-mixed'."
            )
        if self.zero == 0 and self.dp_shard > 1:
            out.append(
                f"plan.dp_shard = {self.dp_shard} with plan.zero = 0: stage 0 shards nothing; "
                "use dp_replicate for plain data parallelism or set zero to 1, 2 or 3."
            )
        if self.dp_replicate > 1 and self.dp_shard > 1 and self.zero != 3:
            out.append(
                f"plan.dp_replicate = {self.dp_replicate} x dp_shard = {self.dp_shard} is HSDP, "
                f"which needs plan.zero = 3 (got {self.zero}); or put all DP ranks in one axis."
            )
        if self.pp == 1 and self.vpp > 1:
            out.append(f"plan.vpp = {self.vpp} needs plan.pp > 1: virtual stages split a pipeline.")
        if self.pp > 1:
            out += self._schedule_problems()
        if self.etp not in (1, self.tp):
            out.append(
                f"plan.etp = {self.etp}: routed experts are whole (etp = 1) or split over the "
                f"whole TP group (etp = plan.tp = {self.tp})."
            )
        elif self.ep > 1 and not ep_fits(self.ep, self.dp_shard, self.cp, moe_token_split(self)):
            span = expert_span(self)
            out.append(
                f"plan.ep = {self.ep} must divide dp_shard * cp"
                + (" * tp" if moe_token_split(self) > 1 else "")
                + f" = {span}: expert parallelism borrows its ranks from the sharded "
                "data-parallel, context (and, with etp = 1, tensor) axes. Raise dp_shard (with "
                "zero >= 1), cp or tp, or lower ep."
            )
        return out

    def _schedule_problems(self) -> list[str]:
        return schedule_problems(self.schedule, self.pp, self.vpp, self.grad_accum)

    def runtime_problems(self, m: ModelSpec | None = None) -> list[str]:
        """What fivefold's runtime refuses although the layout itself is consistent (part of
        `problems`; alone where only some fields are known, e.g. those a search pins)."""
        out = []
        compute = precision_recipe(self.precision).compute_dtype
        if compute not in RUNTIME_COMPUTE_DTYPES:
            out.append(
                f"plan.precision = {self.precision!r} computes in {compute}, which fivefold's "
                "runtime does not implement (the recipe describes fp8 training elsewhere, e.g. "
                "DeepSeek-V3's, for the memory arithmetic of `fivefold.planner.memory.stage`); use "
                "'fp32' or a bf16 recipe such as 'bf16-mixed'."
            )
        out += self._lever_runtime_problems()
        if self.etp > 1:
            out.append(
                f"plan.etp = {self.etp}: fivefold's runtime keeps routed experts whole and "
                "splits a MoE layer's tokens over the TP ranks instead (docs/internals.md, "
                '"MoE with tensor parallelism"); set plan.etp = 1.'
            )
        if m is None:
            return out
        out += self._fp8_kv_problems(m)
        return out

    def _fp8_kv_problems(self, m: ModelSpec) -> list[str]:
        """FP8 key/value projections with tp > kv_heads: fivefold's replicated-KV style (each
        rank's kv head computed from its local weight slice) has no FP8 counterpart."""
        kv = (int(m.kv_width), m.hidden)
        if self.fp8 == "none" or self.tp <= m.kv_heads or m.is_mla:
            return []
        if not converts_to_fp8(self.fp8, *kv):
            return []
        return [
            f"plan.fp8 = {self.fp8!r} with plan.tp = {self.tp} > model.kv_heads = {m.kv_heads}: "
            "the key/value heads are replicated across TP ranks by a style of fivefold's own "
            "that torchao's float8 styles do not cover, and FP8 converts these projections "
            f"({kv[0]} x {kv[1]}); set plan.tp <= {m.kv_heads} or plan.fp8 = 'none'."
        ]

    def _lever_runtime_problems(self) -> list[str]:
        """The memory levers' layout limits in fivefold's runtime (what a device cannot run,
        FP8 off FP8 GPUs or torchao missing, is `fivefold.train.optim.lever_problems`)."""
        out = []
        if self.offload == "all" and self.world_size == 1:
            out.append(
                "plan.offload = 'all' in a single process: parameters and gradients are "
                "offloaded by FSDP2, which fivefold runs only on several processes; use "
                "plan.offload = 'optimizer' (the optimizer step on the host), or dp_shard >= 2."
            )
        if self.fp8 == "rowwise" and self.tp > 1:
            out.append(
                f"plan.fp8 = 'rowwise' with plan.tp = {self.tp}: FP8 linears are tensor-parallel "
                "through torchao's float8 styles, which carry one scale per tensor (tensorwise "
                "scaling) across the FP8 all-gathers; set plan.fp8 = 'tensorwise', or "
                "plan.tp = 1 (shard with dp_shard / zero 3 instead)."
            )
        return out

    def device_problems(self, cluster: ClusterSpec) -> list[str]:
        """What the cluster's device cannot compute, whatever the degrees: FP8 linears off
        GPUs with FP8 matrix units (no fp8 peak in the catalog or the device profile). A GPU
        outside the catalog is asked at start-up instead (its compute capability)."""
        if self.fp8 == "none" or "fp8" in cluster.device.peak_flops:
            return []
        if cluster.gpu == UNKNOWN_GPU and not cluster.profile:
            return []
        cpu = cluster.gpu == "cpu"
        return [
            f"plan.fp8 = {self.fp8!r} on {cluster.gpu}: "
            + ("the CPU has no FP8 arithmetic" if cpu else "it has no FP8 matrix units")
            + "; FP8 training needs a GPU of CUDA compute capability 8.9 or newer (e.g. "
            "h100-sxm, h200, b200). Set plan.fp8 = 'none'"
            + (
                " (`fivefold plan` still plans FP8 runs on such GPUs)."
                if cpu
                else ", or choose such a GPU."
            )
        ]

    def _cluster_problems(self, cluster: ClusterSpec) -> list[str]:
        out = self.device_problems(cluster)
        if self.world_size != cluster.world_size:
            out.append(
                WorldSizeProblem(
                    f"plan degrees multiply to pp {self.pp} x dp_replicate {self.dp_replicate} x "
                    f"dp_shard {self.dp_shard} x cp {self.cp} x tp {self.tp} = {self.world_size}, "
                    f"but the cluster has {cluster.world_size} GPUs ({cluster.nodes} nodes x "
                    f"{cluster.gpus_per_node}); change a degree so the product equals "
                    f"{cluster.world_size}."
                )
            )
        domain = cluster.nvlink_gpus
        if self.tp > domain or domain % self.tp:
            where = "a node" if domain == cluster.gpus_per_node else "an NVLink domain"
            out.append(
                f"plan.tp = {self.tp} must divide the {domain} "
                f"{'GPUs' if cluster.gpu != 'cpu' else 'processes'} of {where}: tensor "
                f"parallelism is on the critical path and must stay inside {where}"
                + (" (on NVLink)." if cluster.device.nvlink_bw_bytes_per_s else ".")
            )
        return out

    def _model_problems(self, m: ModelSpec) -> list[str]:
        out = []
        if m.heads % self.tp:
            out.append(
                f"plan.tp = {self.tp} must divide model.heads = {m.heads}: each TP rank holds "
                "whole attention heads."
            )
        if self.tp > m.kv_heads and self.tp % m.kv_heads:
            out.append(
                f"plan.tp = {self.tp} exceeds model.kv_heads = {m.kv_heads} but is not a multiple "
                "of it, so key/value heads cannot be replicated evenly; pick tp dividing or a "
                "multiple of kv_heads."
            )
        elif self.tp <= m.kv_heads and m.kv_heads % self.tp:
            out.append(f"plan.tp = {self.tp} must divide model.kv_heads = {m.kv_heads}.")
        if m.ffn % self.tp:
            out.append(f"plan.tp = {self.tp} must divide model.ffn = {m.ffn} (the MLP width).")
        shared_width = m.shared_experts * m.expert_ffn if m.is_moe else 0
        if m.is_moe and m.expert_ffn % self.etp:
            out.append(f"plan.etp = {self.etp} must divide model.expert_ffn = {m.expert_ffn}.")
        if shared_width % self.tp:
            out.append(
                f"plan.tp = {self.tp} must divide the shared experts' width model.shared_experts "
                f"x expert_ffn = {shared_width} (they are tensor-parallel like a dense MLP)."
            )
        if self.virtual_stages > m.layers:
            out.append(
                f"plan.pp * vpp = {self.virtual_stages} pipeline stages exceed model.layers = "
                f"{m.layers}: every stage needs at least one layer."
            )
        if self.cp > 1 and m.seq_len % (2 * self.cp):
            out.append(
                f"model.seq_len = {m.seq_len} must be divisible by 2 * plan.cp = {2 * self.cp}: "
                "load-balanced context parallelism gives each rank a head and a tail chunk."
            )
        if self.cp > 1 and m.rope_scaling_type == "dynamic" and m.rope_scaling_factor != 1.0:
            out.append(
                f"plan.cp = {self.cp} with model.rope_scaling_type = 'dynamic': dynamic RoPE "
                "takes its frequencies from the longest position a forward sees, which each CP "
                "rank's share sees differently; set plan.cp = 1 or another RoPE scaling."
            )
        if self.cp > 1 and self.cp_kind == "ulysses" and (m.heads // self.tp) % self.cp:
            out.append(
                f"plan.cp = {self.cp} with plan.cp_kind = 'ulysses' must divide the "
                f"{m.heads // self.tp} attention heads of a TP rank (model.heads / plan.tp): "
                "Ulysses gives each CP rank whole heads; lower cp or use cp_kind = 'ring'."
            )
        if self.sp and self.tp > 1 and (m.seq_len // self.cp) % self.tp:
            out.append(
                f"model.seq_len / cp = {m.seq_len // self.cp} must be divisible by plan.tp = "
                f"{self.tp} for sequence parallelism; change seq_len or set plan.sp = false."
            )
        elif m.is_moe and moe_token_split(self) > 1 and (m.seq_len // self.cp) % self.tp:
            out.append(
                f"model.seq_len / cp = {m.seq_len // self.cp} must be divisible by plan.tp = "
                f"{self.tp}: a MoE layer splits its tokens over the TP ranks along the sequence "
                "(geometry's expert rule); change seq_len or plan.tp."
            )
        if self.ep > 1:
            if not m.is_moe:
                out.append(
                    f"plan.ep = {self.ep} needs a MoE model (model.experts > 0); set ep = 1."
                )
            elif m.experts % self.ep:
                out.append(
                    f"plan.ep = {self.ep} must divide model.experts = {m.experts} so each rank "
                    "holds the same number of experts."
                )
        return out
