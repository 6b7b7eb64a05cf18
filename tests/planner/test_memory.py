"""Memory model: hand-derived bytes for small models, Korthikanti's formulas, sharding rules."""

from __future__ import annotations

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.memory.activations import chunk_activation_bytes, layer_activation_bytes
from fivefold.planner.memory.eager import split_backward_bytes
from fivefold.planner.memory.model_states import (
    chunk_state_bytes,
    layer_params_per_rank,
    model_state_bytes,
    zero_divisors,
)
from fivefold.planner.memory.options import MemoryOptions
from fivefold.planner.memory.stage import all_stage_memory, stage_memory
from fivefold.specs import ModelSpec, ParallelPlan, model_preset, param_count
from fivefold.specs.partition import stage_layer_counts

CLASSIC = MemoryOptions(attention_kernel="classic", dropout=True)


def gpt(h=1024, a=16, s=2048, layers=4) -> ModelSpec:
    """A GPT-3-style model: MHA, GeLU MLP of width 4h (Korthikanti's setting)."""
    return ModelSpec(
        "gpt", layers, h, a, ffn=4 * h, vocab=1000, seq_len=s, mlp="gelu", rope_theta=1e4
    )


# ---- activations after Korthikanti et al. 2022 --------------------------------------------------
def test_korthikanti_no_parallelism():
    m, b = gpt(), 2
    s, h, a = m.seq_len, m.hidden, m.heads
    plan = ParallelPlan(micro_batch=b)
    expected = s * b * h * (34 + 5 * a * s / h)  # eq. (2)
    assert layer_activation_bytes(m, plan, options=CLASSIC) == pytest.approx(expected)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_parallel_without_sp(t):
    m, b = gpt(), 1
    s, h, a = m.seq_len, m.hidden, m.heads
    plan = ParallelPlan(tp=t, sp=False, micro_batch=b)
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  # eq. (4)
    assert layer_activation_bytes(m, plan, options=CLASSIC) == pytest.approx(expected)


@pytest.mark.parametrize("t", [2, 8])
def test_korthikanti_sequence_parallel_and_recompute(t):
    m, b = gpt(), 1
    s, h, a = m.seq_len, m.hidden, m.heads
    plan = ParallelPlan(tp=t, sp=True, micro_batch=b)
    full_sp = s * b * h / t * (34 + 5 * a * s / h)  # eq. (5)
    assert layer_activation_bytes(m, plan, options=CLASSIC) == pytest.approx(full_sp)
    selective = plan.with_(recompute="selective")
    # eq. (6): selective recompute drops exactly the 5as/h score terms.
    assert layer_activation_bytes(m, selective, options=CLASSIC) == pytest.approx(
        s * b * h / t * 34
    )
    full = plan.with_(recompute="full")
    assert layer_activation_bytes(m, full, options=CLASSIC) == pytest.approx(2 * s * b * h / t)


def test_context_parallel_divides_sequence():
    m = gpt()
    one = layer_activation_bytes(m, ParallelPlan(), options=MemoryOptions())
    two = layer_activation_bytes(m, ParallelPlan(cp=2), options=MemoryOptions())
    assert two == pytest.approx(one / 2)  # flash: no s^2 term, everything linear in s


def test_flash_llama_layer_hand_count():
    """The `tiny` preset (h 64, 4 heads of 16, 2 kv heads, SwiGLU 176, s 128), bf16, b = 1."""
    m = model_preset("tiny")
    sb = 128
    per_token = (
        4 * 2 * 64  # two norm inputs, QKV input, MLP input
        + 2 * (64 + 2 * 32)  # Q, K, V (kv width 2 * 16)
        + 2 * 64  # attention output
        + 4 * 4  # fp32 log-sum-exp per head
        + 3 * 2 * 176  # SwiGLU: gate and up inputs, product
    )
    assert per_token == 1968
    got = layer_activation_bytes(m, ParallelPlan(), options=MemoryOptions())
    assert got == pytest.approx(sb * per_token)


def test_gqa_kv_heads_replicated_beyond_tp():
    m = ModelSpec("g", 2, 1024, 16, kv_heads=2, ffn=2816, seq_len=256)
    # tp = 8 > kv_heads = 2: each rank keeps one whole kv head of 64.
    lp = layer_params_per_rank(m, moe=False, tp=8, ep=1)
    wq_wo = 2 * 1024 * 1024 / 8
    wk_wv = 2 * 1024 * 64
    mlp = 3 * 1024 * 2816 / 8
    assert lp.dense == pytest.approx(wq_wo + wk_wv + mlp)
    assert lp.replicated == 2 * 1024


def test_simple_activation_model_option():
    m = model_preset("small")
    plan = ParallelPlan(micro_batch=2)
    opts = MemoryOptions(activation_model="simple")
    assert layer_activation_bytes(m, plan, options=opts) == 12 * 2 * 256 * 256 * 2


# ---- the four tenants per stage -----------------------------------------------------------------
def test_single_gpu_tenants_equal_param_count():
    m = model_preset("small")
    plan = ParallelPlan(precision="bf16-mixed")
    mem = stage_memory(m, plan, 0, 1)
    n = param_count(m)
    assert mem.params == pytest.approx(2 * n)
    assert mem.grads == pytest.approx(2 * n)
    assert mem.optimizer == pytest.approx(12 * n)


def test_tp_shards_sum_to_model():
    m = model_preset("small")  # 8 heads, 4 kv heads
    t = 4
    mem = stage_memory(m, ParallelPlan(tp=t), 0, 1)
    replicated = m.layers * 2 * m.hidden + m.hidden  # norms stay whole on every rank
    assert mem.params / 2 * t == pytest.approx(param_count(m) + (t - 1) * replicated)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_sharding_of_a_stage(zero):
    m = model_preset("small")
    plan = ParallelPlan(dp_shard=4 if zero else 1, dp_replicate=1 if zero else 4, zero=zero)
    mem = stage_memory(m, plan, 0, 1)
    n = param_count(m)
    dp, dg, do = zero_divisors(zero, 4)
    assert mem.params == pytest.approx(2 * n / dp)
    assert mem.grads == pytest.approx(2 * n / dg)
    assert mem.optimizer == pytest.approx(12 * n / do)


def test_first_stage_holds_embedding_last_holds_head():
    m = model_preset("small")  # untied: embedding and head both vocab x hidden
    plan = ParallelPlan(pp=2, grad_accum=4)
    counts = stage_layer_counts(m, 2)
    first, last = (stage_memory(m, plan, r, 1, counts=counts) for r in (0, 1))
    layer = layer_params_per_rank(m, False, 1, 1).total
    assert first.params / 2 == pytest.approx(counts[0] * layer + m.vocab * m.hidden)
    assert last.params / 2 == pytest.approx(counts[1] * layer + m.vocab * m.hidden + m.hidden)
    assert "logits" in last.other_terms and "logits" not in first.other_terms
    assert last.other_terms["logits"] == pytest.approx(256 * 4096 * 12)


def test_tied_embeddings_pipelined_keep_a_copy():
    m = model_preset("small").with_(tied_embeddings=True)
    single = stage_memory(m, ParallelPlan(), 0, 1)
    assert single.params / 2 == pytest.approx(param_count(m))
    last = stage_memory(m, ParallelPlan(pp=2, grad_accum=2), 1, 1)
    counts = stage_layer_counts(m, 2)
    layer = layer_params_per_rank(m, False, 1, 1).total
    assert last.params / 2 == pytest.approx(counts[1] * layer + m.vocab * m.hidden + m.hidden)


def test_inflight_scales_activations():
    m = model_preset("small")
    plan = ParallelPlan(pp=2, grad_accum=8)
    counts = stage_layer_counts(m, 2)
    one = chunk_activation_bytes(m, plan, counts, 0)
    mems = all_stage_memory(m, plan, [2, 1])
    assert mems[0].activations == pytest.approx(2 * one)
    assert mems[1].stage == 1


def test_full_recompute_adds_one_layer_working_set():
    m = model_preset("small")
    plan = ParallelPlan(recompute="full")
    mem = stage_memory(m, plan, 0, 1)
    stored = m.layers * 2 * 256 * m.hidden + 2 * 2 * 256 * m.hidden  # inputs + final norm, head
    working = layer_activation_bytes(m, plan, recompute="none")
    assert mem.activations == pytest.approx(stored + working)


def test_other_terms_are_named_and_conditional():
    m = model_preset("small")
    z3 = stage_memory(m, ParallelPlan(dp_shard=2, zero=3, tp=2), 0, 1)
    assert {"cuda_context", "zero3_gathered_layers", "sp_gathered_input", "fragmentation"} <= set(
        z3.other_terms
    )
    layer = layer_params_per_rank(m, False, 2, 1).total
    assert z3.other_terms["zero3_gathered_layers"] == pytest.approx(layer * (2 * 2 + 2))
    ddp = stage_memory(m, ParallelPlan(dp_replicate=2), 0, 1)
    assert ddp.other_terms["dp_grad_buckets"] == 2 * 25 * 2**20
    tensors = ddp.total - ddp.other_terms["fragmentation"]
    assert ddp.other_terms["fragmentation"] == pytest.approx(0.05 * tensors)


def test_moe_experts_sharded_by_ep():
    m = model_preset("tiny-moe")  # 4 experts of width 64, top-2, one shared
    lp1 = layer_params_per_rank(m, True, tp=1, ep=1)
    lp2 = layer_params_per_rank(m, True, tp=1, ep=2)
    assert lp1.experts == 4 * 3 * 64 * 64
    assert lp2.experts == lp1.experts / 2
    assert lp1.replicated == 2 * 64 + 64 * 4  # norms + router


# ---- partition ----------------------------------------------------------------------------------
def test_stage_layer_counts_balanced_with_head():
    m = model_preset("llama3-8b")
    counts = stage_layer_counts(m, 4)
    assert sum(counts) == 32 and min(counts) >= 1
    assert counts[-1] < counts[1]  # the 1.05 GFLOP/token head takes about two layers' place
    assert stage_layer_counts(m, 1) == [32]
    assert stage_layer_counts(m, 32) == [1] * 32
    uniform = model_preset("llama3-8b").with_(vocab=8)
    assert stage_layer_counts(uniform, 4) == [8, 8, 8, 8]


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_inputs_raise_config_errors():
    with pytest.raises(ConfigError, match="parameter count"):
        model_state_bytes(-1, "bf16-mixed")
    with pytest.raises(ConfigError, match="ZeRO stage"):
        model_state_bytes(1e9, "bf16-mixed", zero=4)
    with pytest.raises(ConfigError, match="activation_model"):
        stage_memory(model_preset("tiny"), ParallelPlan(), 0, 1, MemoryOptions("k12"))
    with pytest.raises(ConfigError, match="unknown"):
        model_state_bytes(1e9, "int4")
    with pytest.raises(ConfigError, match=r"exceed model\.layers"):
        stage_layer_counts(model_preset("tiny"), 3)


# ---- runtime = "fivefold-eager": what fivefold's own runtime keeps -----------------------------
EAGER = MemoryOptions(runtime="fivefold-eager", cuda_context_bytes=0, fragmentation_fraction=0)
SMALL_PARAMS = 6_450_432  # the small preset (hidden 256, 6 layers, ffn 688, vocab 4096)


def test_eager_small_layer_hand_count():
    # small, fp32 (e = 4), one sequence of s = 256 tokens, h = q = 256, kv = 128, f = 688,
    # 8 heads of 32: sbh = 65,536 elements = 262,144 B.
    # Two RMSNorms each keep their input and the output the next matmul keeps (2 sbh) plus
    # 1 KiB of reciprocal RMS; attention keeps q (sbh), k and v (kv wide, sbh/2 each), its
    # output (sbh) and an fp32 log-sum-exp (8 KiB); SwiGLU keeps three f-wide tensors. (The
    # RoPE tables, 2 x 4 s Dh = 64 KiB, are counted once per chunk.)
    m = model_preset("small")
    plan = ParallelPlan(precision="fp32", micro_batch=1)
    sbh = 262_144
    expected = 4 * sbh + 2 * 1024 + 3 * sbh + 8192 + 3 * 4 * 256 * 688
    assert expected == 3_958_784  # the saved tensors of one block (tests/test_saved_activations)
    assert layer_activation_bytes(m, plan, options=EAGER) == expected
    # The fused formula (3 f-wide tensors, norm input and output only): the same less the
    # reciprocal RMS.
    assert layer_activation_bytes(m, plan) == 7 * sbh + 3 * 4 * 256 * 688 + 8192


def test_eager_single_process_stage_hand_count():
    # 1 rank, fp32, mbs 2, accumulation 1, FSDP2-wrapped (replicate): params P = 4 B/param,
    # the gathered copy of them another 4 B, AdamW m and v 8 B; no gradients yet at the peak
    # (FSDP2 allocates them in the backward that follows it); activations = 6 layers x 2
    # sequences + the final norm (2 x 2 sbh + 2 KiB) + the embedding's int64 indices, and the
    # RoPE tables (2 x 4 x 512 x 32); the head's loss at its largest, in its forward: the input
    # gradient (4 x 512 x 256) and one chunk of all 512 tokens' fp32 logits and softmax (8 B
    # per logit, 512 x 4096 logits).
    m = model_preset("small")
    plan = ParallelPlan(precision="fp32", micro_batch=2)
    mem = stage_memory(m, plan, 0, 1, EAGER)
    P = SMALL_PARAMS * 4
    acts = 6 * 2 * 3_958_784 + 2 * 2 * 262_144 + 2 * 1024 + 8 * 512 + 2 * 4 * 512 * 32
    loss = 4 * 512 * 256 + 8 * 512 * 4096
    assert not mem.grads_at_peak
    assert mem.activations == acts
    assert mem.other_terms == {
        "cuda_context": 0,
        "logits": loss,
        "fsdp_param_shards": P,
        "fragmentation": 0,
    }
    assert mem.total == P + P + 2 * P + acts + loss
    # One process without FSDP (LocalRuntime): no second copy of the weights.
    local = stage_memory(m, plan, 0, 1, MemoryOptions(**{**EAGER.__dict__, "fsdp_wrapped": False}))
    assert local.total == mem.total - P


def test_eager_fsdp_terms_replace_ddp_buckets():
    m = model_preset("small")
    zero0 = stage_memory(m, ParallelPlan(precision="fp32", dp_replicate=2), 0, 1, EAGER)
    assert "dp_grad_buckets" not in zero0.other_terms  # FSDP2's replicate has no buckets
    zero1 = stage_memory(m, ParallelPlan(precision="fp32", dp_shard=2, zero=1), 0, 1, EAGER)
    assert zero1.other_terms["fsdp_param_shards"] == SMALL_PARAMS * 4 / 2  # weights at rest
    zero3 = stage_memory(m, ParallelPlan(precision="fp32", dp_shard=2, zero=3), 0, 1, EAGER)
    # ZeRO-3 keeps the root's parameters gathered (embedding, final norm, head: not
    # re-sharded after forward): 2 x 4096 x 256 + 256 fp32 values.
    assert zero3.other_terms["zero3_gathered_roots"] == (2 * 4096 * 256 + 256) * 4
    # With accumulation the gradients (sharded: ZeRO-3 reduce-scatters every micro-batch)
    # exist at the last micro-batch's peak. The peak is in the fifth block's backward
    # (`eager_block_prebackward_excess`), where without accumulation only the sixth block's
    # new shard exists: 256 x 256 x 2 + 256 x 128 x 2 + 3 x 256 x 688 + 2 x 256 values / 2.
    accum = stage_memory(
        m, ParallelPlan(precision="fp32", dp_shard=2, zero=3, grad_accum=2), 0, 1, EAGER
    )
    assert accum.grads_at_peak
    block_shard = (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256) * 4 / 2
    assert accum.total - zero3.total == pytest.approx(SMALL_PARAMS * 4 / 2 - block_shard)


def test_eager_expert_shards_at_rest_divided_by_the_expert_group():
    # tiny-moe over 2 ranks, fp32 ZeRO-1, EP2: the routed experts (2 layers x 4 experts x
    # 3 x 64 x 64) split over the EP ranks, each rank's 2 experts sharded over the expert
    # data-parallel group (1 rank: FSDP2 keeps them whole at rest, beside their gathered
    # copy), the other parameters over both ranks.
    m = model_preset("tiny-moe")
    ep2 = stage_memory(m, ParallelPlan(precision="fp32", dp_shard=2, zero=1, ep=2), 0, 1, EAGER)
    experts = 2 * 4 * 3 * 64 * 64
    rest = param_count(m) - experts
    assert ep2.other_terms["fsdp_param_shards"] == (rest / 2 + experts / 2) * 4


def test_gpipe_last_stage_keeps_every_micro_batch_log_softmax():
    # GPipe runs all m forwards before any backward: the last stage keeps m fp32 log-softmax
    # outputs (4 B per logit each) and, in the first backward, two fp32 gradients (8 B).
    m = model_preset("small")
    logits = 256 * 4096
    gpipe = stage_memory(m, ParallelPlan(pp=2, schedule="gpipe", grad_accum=4), 1, 4)
    assert gpipe.other_terms["logits"] == logits * (12 + 4 * 3)
    one_f1b = stage_memory(m, ParallelPlan(pp=2, schedule="1f1b", grad_accum=4), 1, 1)
    assert one_f1b.other_terms["logits"] == logits * 12


def test_split_backward_keeps_every_weight_output_gradient():
    # small, fp32, mbs 1 (sb = 256): per layer the gradients of Q, K, V (256 + 2 x 128), of the
    # attention and MLP outputs and of the two norm outputs (4 x 256), of gate and up (2 x 688).
    m = model_preset("small")
    plan = ParallelPlan(precision="fp32", pp=2, vpp=2, schedule="zbv", grad_accum=4)
    counts = stage_layer_counts(m, 4)
    assert counts == [2, 1, 2, 1]
    per_layer = 4 * 256 * (256 + 2 * 128 + 4 * 256 + 2 * 688)
    assert split_backward_bytes(m, plan, counts, 1, 4) == per_layer
    assert split_backward_bytes(m, plan, counts, 2, 4) == 2 * per_layer


def test_zbv_rank1_peak_walks_slots_sends_and_the_split_backward_by_hand():
    # Rank 1 holds chunks 1 and 2 (both fed by a chunk on the other rank or on itself). Its peak
    # is at the end of B(mb 2, chunk 2): micro-batches 2 and 3 of both chunks in flight (their
    # inputs are receive slots, counted apart), the four outputs of chunk 2 sent to rank 0 and
    # the two input gradients chunk 1 sent back, and what B(2, 2) keeps for its W.
    m = model_preset("small")
    plan = ParallelPlan(precision="fp32", pp=2, vpp=2, schedule="zbv", grad_accum=4)
    counts = stage_layer_counts(m, 4)
    x = 4 * 256 * 256  # one micro-batch's hidden states, fp32
    a1, a2 = (chunk_activation_bytes(m, plan, counts, c, EAGER) for c in (1, 2))
    kept = split_backward_bytes(m, plan, counts, 2, 4)
    mem = stage_memory(m, plan, 1, 4, EAGER)
    assert mem.activations == pytest.approx(2 * (a1 - x) + 2 * (a2 - x) + 4 * x + 2 * x + kept)
    # Per micro-batch a receive slot for each chunk's input and for each output gradient.
    assert mem.other_terms["pipeline_slots"] == 4 * 4 * x
    assert mem.grads_at_peak == 1.0  # both chunks ran a W before


def test_dualpipev_rank0_has_both_chunks_gradients_at_its_peak():
    # Rank 0 holds chunks 0 (2 layers and the embedding) and 3 (1 layer, the final norm and the
    # head). With the head inside the loss (no fp32 logits) its activations peak last after a
    # backward of each chunk: both chunks' gradients exist (fp32). Before, with the logits, the
    # peak came in chunk 3's second backward, with only chunk 3's gradients.
    m = model_preset("small")
    plan = ParallelPlan(precision="fp32", pp=2, vpp=2, schedule="dualpipev", grad_accum=4)
    mem = stage_memory(m, plan, 0, 4, EAGER)
    layer = 2 * 256 + 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688  # norms, attention, MLP
    chunk0 = 2 * layer + 4096 * 256
    chunk3 = layer + 256 + 4096 * 256
    assert mem.grads * mem.grads_at_peak == pytest.approx(4 * (chunk0 + chunk3))


def test_tp_embedding_gradient_is_its_vocabulary_shard_under_eager():
    # the vocab-parallel lookup makes the embedding's gradient on its V/t rows
    # (`fivefold.parallel.tensor_parallel.VocabParallelEmbedding`): no full-vocabulary buffer
    m = model_preset("small")
    plan = ParallelPlan(precision="fp32", tp=2, pp=2, schedule="1f1b", grad_accum=4)
    mem = stage_memory(m, plan, 0, 2, EAGER)
    assert mem.grads_at_peak == 1.0
    layer = 2 * 256 + (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688) / 2  # norms, TP2 shards
    assert mem.grads == 4 * (4 * layer + 4096 * 256 / 2)  # 4 layers of 6, the embedding's half
    fused = stage_memory(m, plan, 0, 2)
    assert fused.grads_at_peak == 1.0  # the fused option is unchanged


# ---- fivefold-eager under bf16 compute (FSDP2's MixedPrecisionPolicy) ----------------------------
def test_eager_bf16_state_is_fp32_shards_and_fp32_gradients():
    # ZeRO-3 over 2 ranks: the fp32 shard is the master (4 B), gradient shards fp32 (4 B), the
    # optimizer only m and v (8 B); no resting bf16 copy. ZeRO-1 keeps the recipe's gathered
    # bf16 copy (2 B, unsharded) and its 12 B optimizer tenant (master included), fp32 grads.
    m = model_preset("small")
    counts = stage_layer_counts(m, 1)
    zero3 = ParallelPlan(dp_shard=2, zero=3)
    held = chunk_state_bytes(m, zero3, counts, 0, eager=True)
    n = SMALL_PARAMS
    assert (held.params, held.grads, held.optimizer) == (n * 4 / 2, n * 4 / 2, n * 8 / 2)
    fused = chunk_state_bytes(m, zero3, counts, 0)
    assert (fused.params, fused.grads, fused.optimizer) == (n * 2 / 2, n * 2 / 2, n * 12 / 2)
    zero1 = chunk_state_bytes(m, ParallelPlan(dp_shard=2, zero=1), counts, 0, eager=True)
    assert (zero1.params, zero1.grads, zero1.optimizer) == (n * 2, n * 4, n * 12 / 2)
    fp32 = ParallelPlan(dp_shard=2, zero=3, precision="fp32")
    assert chunk_state_bytes(m, fp32, counts, 0, eager=True) == chunk_state_bytes(
        m, fp32, counts, 0
    )


def test_eager_pipelined_zero3_peak_holds_unsharded_fp32_gradients():
    # pp 2, 1F1B, 4 micro-batches: rank 0's peak is the forward of micro-batch 2, after the
    # backward of micro-batch 0 allocated the chunk's gradients, unsharded (the stages skip the
    # reduce-scatter until the last micro-batch) and fp32 (FSDP2 reduce dtype): its layers
    # (4 of the 6: the partition balances the head) and the embedding, 4 B each.
    m = model_preset("small")
    plan = ParallelPlan(dp_shard=2, zero=3, pp=2, grad_accum=4)
    mem = stage_memory(m, plan, 0, 2, EAGER)
    layer = 2 * 256 + 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688
    assert stage_layer_counts(m, 2) == [4, 2]
    assert mem.grads * mem.grads_at_peak == pytest.approx(4 * (4 * layer + 4096 * 256))
    assert "zero3_unsharded_grads" not in mem.other_terms


def test_eager_rope_tables_once_per_chunk_and_the_head_loss():
    # bf16 compute under FSDP2 as in fp32: the 6 blocks share one fp32 cos and sin pair
    # [1, 256, 1, 32] (blocks wrapped with cast_forward_inputs=False, no bf16 copy per block).
    # The head's loss (bf16, 256 tokens): its forward, the input gradient (e N h; under tp 2
    # also the gathered input) and one chunk of all 256 tokens' logits: 8 B fp32 + 2 B bf16
    # per local logit.
    m = model_preset("small")
    counts = stage_layer_counts(m, 1)
    bf16 = ParallelPlan()
    fp32 = ParallelPlan(precision="fp32")
    layers = 6 * layer_activation_bytes(m, bf16, options=EAGER)
    fixed = chunk_activation_bytes(m, bf16, counts, 0, EAGER) - layers
    final_norm = (2 * 256 * 256 + 4 * 256) + 2 * 256 * 256
    assert fixed == final_norm + 2 * 4 * 256 * 32 + 8 * 256  # + int64 token indices
    fixed32 = chunk_activation_bytes(m, fp32, counts, 0, EAGER) - 6 * layer_activation_bytes(
        m, fp32, options=EAGER
    )
    assert fixed32 == (4 * 256 * 256 + 4 * 256) + 4 * 256 * 256 + 2 * 4 * 256 * 32 + 8 * 256
    tp2 = stage_memory(m, ParallelPlan(tp=2), 0, 1, EAGER)
    assert tp2.other_terms["logits"] == 2 * (2 * 256 * 256) + 10 * 256 * 4096 / 2
    one = stage_memory(m, ParallelPlan(), 0, 1, EAGER)
    assert one.other_terms["logits"] == 2 * 256 * 256 + 10 * 256 * 4096
