"""Hugging Face interop (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3:
`fivefold.checkpoint.hf_families`; tensor names `fivefold.checkpoint.hf_tensors`): export a
checkpoint to `config.json` + safetensors, import one back.

Details: docs/checkpoints.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fivefold.checkpoint.checkpointer import Checkpointer
from fivefold.checkpoint.dcp_io import read_full_tensors
from fivefold.checkpoint.hf_families import (
    IMPORTABLE_FAMILIES,
    MOE_FAMILIES,
    context_length,
    family_config_fields,
    family_problems,
    hf_family,
    model_fields,
    rope_config_fields,
)
from fivefold.checkpoint.hf_tensors import (
    check_hf_tensors,
    from_hf_tensors,
    normalised_hf,
    to_hf_tensors,
)
from fivefold.checkpoint.state import read_state
from fivefold.errors import CheckpointError, ConfigError
from fivefold.model import build_model
from fivefold.model.rope_scaling import LONGROPE_LIMIT
from fivefold.specs.hf_config import spec_from_hf_config
from fivefold.specs.model import RUNTIME_ROPE_SCALINGS, ModelSpec

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
FILE_MODE = 0o644  # readable by whoever serves the model (safetensors writes 0600)
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = ("fp32", "bf16", "fp16")
_SHARD_BYTES = 5 * 2**30


# ---- config ----------------------------------------------------------------------------------
def check_exportable(spec: ModelSpec) -> None:
    """CheckpointError naming what `spec` has that no Hugging Face family it writes has."""
    if spec.mlp != "swiglu":
        raise CheckpointError(
            f"cannot export to Hugging Face: model.mlp = {spec.mlp!r} (every family fivefold "
            "writes has a SwiGLU MLP)."
        )
    hf_family(spec)  # a family with its attention and experts


def llama_config(spec: ModelSpec, dtype: str = "fp32", eod_id: int | None = None) -> dict[str, Any]:
    """The `config.json` of `LlamaForCausalLM` for `spec`, or of the family its attention and
    experts make it (`hf_family`; transformers 4.x and 5.x keys); with the tokenizer's
    end-of-document id as bos/eos/pad when it is known."""
    torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    special = (
        {}
        if eod_id is None
        else {"bos_token_id": eod_id, "eos_token_id": eod_id, "pad_token_id": eod_id}
    )
    return special | {
        **family_config_fields(spec),
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.rope_dim,  # DeepSeek-V3's config: the RoPE part of a head
        "max_position_embeddings": context_length(spec),
        "rms_norm_eps": spec.norm_eps,
        **rope_config_fields(spec),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
        "fivefold_model_name": spec.name,
    }


# Llama `config.json` fields: those that define the model (each read or checked below) and those
# that do not change its weights or its function (ids, bookkeeping, generation defaults).
LLAMA_MODEL_FIELDS = frozenset(
    [
        "model_type",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "attention_dropout",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "fivefold_model_name",
    ]
)
HARMLESS_CONFIG_FIELDS = frozenset(
    [
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "pretraining_tp",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "tokenizer_class",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "output_router_logits",  # whether transformers' forward returns them
    ]
)


def spec_from_llama_config(config: dict[str, Any], where: str = CONFIG_FILE) -> ModelSpec:
    """A ModelSpec equal to a Llama, Qwen2 or Qwen3 `config.json` (read by
    `fivefold.specs.hf_config`, which plans any supported family); CheckpointError naming what
    fivefold cannot train or load."""
    typed = {key: int for key in _INT_FIELDS} | {key: float for key in _FLOAT_FIELDS}
    wrong = [
        f"{key} = {config[key]!r} is not {'an integer' if kind is int else 'a number'}"
        for key, kind in typed.items()
        if config.get(key) is not None and not _is_number(config[key], kind)
    ]
    if wrong:  # before anything reads them as numbers
        raise CheckpointError(
            f"{where} cannot be imported: " + "; ".join(wrong) + "; write each as a JSON number."
        )
    gap = _not_yet_imported(config)
    if gap:
        raise CheckpointError(
            f"{where} cannot be imported: {gap}. `fivefold plan --hf-config {where}` plans it."
        )
    problems = family_problems(config)
    family = config.get("model_type")
    defining = model_fields(str(family), LLAMA_MODEL_FIELDS)
    unknown = sorted(set(config) - defining - HARMLESS_CONFIG_FIELDS)
    if unknown:
        problems.append(
            f"unknown field(s) {', '.join(unknown)}: fivefold cannot tell whether they change "
            "the model (remove them from config.json if they do not)"
        )
    if float(config.get("router_jitter_noise") or 0.0) != 0.0:
        problems.append(
            f"router_jitter_noise = {config['router_jitter_noise']!r} (fivefold's router adds "
            "no noise; set it to 0)"
        )
    if float(config.get("attention_dropout") or 0.0) != 0.0:
        problems.append(
            f"attention_dropout = {config['attention_dropout']!r} (fivefold trains without dropout)"
        )
    if family not in IMPORTABLE_FAMILIES:
        problems.append(
            f"model_type = {family!r} (fivefold imports {', '.join(IMPORTABLE_FAMILIES)})"
        )
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config.get('hidden_act')!r} (fivefold's SwiGLU is silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key) and key in defining:
            problems.append(
                f"{key} = true (fivefold's only biases are Qwen2's, on Q, K and V: none on the "
                "output projection or the MLP)"
            )
    rope_type = _rope_type(config)
    if rope_type not in ("default", *RUNTIME_ROPE_SCALINGS):
        problems.append(
            f"RoPE type {rope_type!r} (fivefold implements 'default', "
            f"{', '.join(repr(kind) for kind in RUNTIME_ROPE_SCALINGS)}"
            + (f"; {LONGROPE_LIMIT}" if rope_type == "longrope" else "")
            + ")"
        )
    if problems:
        raise CheckpointError(f"{where} cannot be imported: " + "; ".join(problems) + ".")
    name = str(config.get("fivefold_model_name", f"hf-{family}"))
    eps = {"rms_norm_eps": 1e-5} if family in ("llama", "mixtral") else {}  # Qwen's: 1e-6
    try:
        spec = spec_from_hf_config({**eps, **config}, where, name)
    except ConfigError as err:
        raise CheckpointError(err.problems) from None
    if spec.runtime_problems():
        raise CheckpointError(spec.runtime_problems())
    return spec


_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _not_yet_imported(config: dict[str, Any]) -> str:
    """Why a dense family's config with experts is refused ("" otherwise)."""
    family = config.get("model_type")
    experts = next((k for k in _EXPERT_FIELDS if config.get(k)), None)
    if experts is None or family in MOE_FAMILIES:
        return ""
    return (
        f"{experts} = {config[experts]!r} makes it a mixture-of-experts model, which "
        f"model_type = {family!r} is not; fivefold imports experts as {', '.join(MOE_FAMILIES)}"
    )


def _rope_type(config: dict[str, Any]) -> str:
    """The RoPE type either spelling names ('default' when neither does)."""
    for settings in (config.get("rope_parameters"), config.get("rope_scaling")):
        if isinstance(settings, dict) and ("rope_type" in settings or "type" in settings):
            return str(settings.get("rope_type", settings.get("type")))
    return "default"


_INT_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
_FLOAT_FIELDS = (
    "rms_norm_eps",
    "attention_dropout",
    "rope_theta",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "routed_scaling_factor",
)


def _is_number(value: Any, kind: type) -> bool:
    """Whether a JSON value is an integer (`kind` int; 4096.0 counts) or any finite-typed number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return kind is float or float(value).is_integer()


def tokenizer_files(tokenizer, spec: ModelSpec) -> dict[str, str]:
    """`tokenizer.json`, `tokenizer_config.json` and `generation_config.json` (file -> text) for
    a fivefold `TextTokenizer`: its end-of-document token is bos, eos and pad."""
    eod = tokenizer.eod_id
    eod_token = tokenizer.backend.id_to_token(eod)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod_token,
        "eos_token": eod_token,
        "pad_token": eod_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": spec.seq_len,
        "clean_up_tokenization_spaces": False,
    }
    generation = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}
    return {
        TOKENIZER_FILE: tokenizer.backend.to_str(),
        TOKENIZER_CONFIG_FILE: json.dumps(tokenizer_config, indent=2) + "\n",
        GENERATION_CONFIG_FILE: json.dumps(generation, indent=2) + "\n",
    }


# ---- export ----------------------------------------------------------------------------------
def export_hf(
    checkpoint_dir: Path, out_dir: Path, dtype: str = "fp32", tokenizer=None
) -> dict[str, Any]:
    """Write `out_dir/config.json` and safetensors from a fivefold checkpoint of any layout, and
    the tokenizer files when `tokenizer` (a `TextTokenizer`) is given.

    Returns a summary (model name, step, parameter count, bytes written, files). No process
    group. A tokenizer with more tokens than the model's vocabulary is refused.
    """
    if dtype not in _DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {', '.join(_DTYPES)}.")
    checkpoint_dir = Path(checkpoint_dir)
    state = read_state(checkpoint_dir)
    spec = ModelSpec(**{k: v for k, v in state.model_spec.items() if k != "notes"})
    check_exportable(spec)
    tensors = read_full_tensors(checkpoint_dir)
    cast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    hf = {
        name: value.to(cast).contiguous()
        for name, value in sorted(to_hf_tensors(spec, tensors).items())
    }
    if tokenizer is not None:
        tokenizer.check_fits(spec.vocab)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _write_safetensors(hf, out_dir, save_file)
    eod = tokenizer.eod_id if tokenizer is not None else None
    texts = {CONFIG_FILE: json.dumps(llama_config(spec, dtype, eod), indent=2) + "\n"}
    if tokenizer is not None:
        texts |= tokenizer_files(tokenizer, spec)
    for name, text in texts.items():
        (out_dir / name).write_text(text)
    files = [*texts, *files]
    for name in files:
        (out_dir / name).chmod(FILE_MODE)
    return {
        "model": spec.name,
        "step": state.step,
        "parameters": sum(t.numel() for t in hf.values()),
        "bytes": sum((out_dir / f).stat().st_size for f in files),
        "files": files,
    }


def _write_safetensors(tensors: dict, out_dir: Path, save_file) -> list[str]:
    """One `model.safetensors`, or 5 GiB shards plus the index HF loaders expect."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = {"format": "pt"}
    if total <= _SHARD_BYTES:
        save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata=meta)
        return [WEIGHTS_FILE]
    shards: list[dict] = [{}]
    size = 0
    for name, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out_dir / name), metadata=meta)
        weight_map.update({key: name for key in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


# ---- import ----------------------------------------------------------------------------------
def read_hf(hf_dir: Path) -> tuple[ModelSpec, dict[str, Any]]:
    """The ModelSpec and fivefold-named fp32 tensors of a Hugging Face directory, its tensors
    checked (names, shapes) against the model its config describes before any is read."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(
            f"{str(hf_dir)!r} has no {CONFIG_FILE}; give the directory of a Hugging Face Llama "
            "model (config.json + *.safetensors)."
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{str(config_path)!r} is not valid JSON ({err}).") from None
    spec = spec_from_llama_config(config, str(config_path))
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{str(hf_dir)!r} has no *.safetensors files (pickled .bin weights are not read)."
        )
    metas = _read_safetensors(files, lambda handle, name: _meta(handle.get_slice(name)))
    shapes = {name: tuple(meta.shape) for name, meta in normalised_hf(spec, metas).items()}
    check_hf_tensors(spec, shapes, repr(str(hf_dir)))
    tensors = _read_safetensors(files, lambda handle, name: handle.get_tensor(name).float())
    interleave = bool(config.get("rope_interleave", True))
    return spec, from_hf_tensors(spec, normalised_hf(spec, tensors), interleave)


def _meta(tensor_slice) -> torch.Tensor:
    """A meta tensor of a stored tensor's shape (its layout read without its data)."""
    return torch.empty(tensor_slice.get_shape(), device="meta")


def _read_safetensors(files: list[Path], read) -> dict[str, Any]:
    """HF name -> `read(handle, name)` for every tensor of `files` but rotary tables."""
    out: dict[str, Any] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if not name.endswith("rotary_emb.inv_freq"):
                        out[name] = read(handle, name)
        except (OSError, ValueError, RuntimeError, SafetensorError) as err:
            raise CheckpointError(
                f"{str(path)!r} is not a readable safetensors file ({err}); it may be truncated "
                "or corrupt: download or export it again."
            ) from None
    return out


def import_hf(
    hf_dir: Path, root: Path, plan: dict[str, Any] | None = None, seq_len: int | None = None
) -> Path:
    """Write the HF model as a weights-only fivefold checkpoint `root/step_0`; returns it.

    The tensors are checked against the model fivefold builds from the config (names, shapes:
    `read_hf`). `seq_len` replaces the config's max_position_embeddings as the training
    sequence length.
    """
    spec, tensors = read_hf(hf_dir)
    if seq_len is not None:
        spec = spec.with_(seq_len=seq_len)
    model = build_model(spec)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            param.copy_(tensors[name])
    return Checkpointer(Path(root), keep=0).save(
        0,
        [model],
        None,
        model_spec=spec.to_dict(),
        plan=dict(plan or {}),
        extra={"imported_from": str(Path(hf_dir).resolve())},
    )
