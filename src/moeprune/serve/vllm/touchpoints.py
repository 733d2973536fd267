"""Every vLLM name moeprune's plugin imports, patches or reads, as one table.

The plugin subclasses vLLM's classes, swaps two names in its model modules while a model is
built, wraps one static method and writes into two registries. Each of those is a promise about
vLLM's code that a minor release may break, so they are listed here and checked against each
release in the tested range (version.TESTED_VLLM) by reading that release's own Python sources
(tests/serve/test_vllm33_sources.py: vLLM 0.32 in .venv-vllm, 0.33 in .venv-vllm33, which has no
CPU build to run). The same test parses the plugin's modules and fails when they import a vLLM
name this table lacks, so a new touch point cannot go unchecked.

Standard library only: nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

# the plugin's modules whose `from vllm... import` statements the table must cover
PLUGIN_MODULES = (
    "moeprune/serve/vllm_plugin.py",
    "moeprune/serve/vllm/models.py",
    "moeprune/serve/vllm/moe.py",
    "moeprune/serve/vllm/novices.py",
)


@dataclass(frozen=True)
class Touch:
    """One vLLM name: `module` (dotted) defines `name` at its top level; for a class,
    `members` are methods or attributes the plugin calls, overrides or reads (defined in the
    class or one of its bases in the same package); for a callable, `params` are the keyword
    parameters the plugin binds by name. `why` says what the plugin does with it."""

    module: str
    name: str
    why: str
    members: tuple[str, ...] = ()
    params: tuple[str, ...] = ()


_FUSED = "vllm.model_executor.layers.fused_moe"
# FusedMoEFactory's parameters that moe._sized_factory reads or rewrites by name
FACTORY_PARAMS = tuple(
    [
        "prefix",
        "router",
        "runner_cls",
        "runner_args",
        "custom_routing_function",
        "hash_indices_table",
        "zero_expert_type",
        "enable_eplb",
        "fuse_shared_experts",
        "e_score_correction_bias",
        "tp_size",
        "intermediate_size",
        "num_experts",
        "top_k",
        "renormalize",
        "use_grouped_topk",
        "num_expert_group",
        "topk_group",
        "scoring_func",
        "routed_scaling_factor",
        "apply_routed_scale_to_output",
        "params_dtype",
        "hidden_size",
        "gate",
        "shared_experts",
        "shared_expert_gate",
        "routed_input_transform",
        "routed_output_transform",
        "n_shared_experts",
    ]
)

TOUCHPOINTS: tuple[Touch, ...] = (
    Touch("vllm", "__version__", "the plugin's version check (version.is_tested)"),
    Touch(
        "vllm",
        "ModelRegistry",
        "registers the MoePrune* architectures; models.served_class reads its classes",
    ),
    Touch(
        "vllm.model_executor.models.registry",
        "_ModelRegistry",
        "ModelRegistry's class",
        members=("register_model", "models"),
    ),
    Touch("vllm.transformers_utils.config", "_CONFIG_REGISTRY", "the moeprune_<family> config types"),
    Touch(
        "vllm.transformers_utils.model_arch_config_convertor",
        "MODEL_ARCH_CONFIG_CONVERTORS",
        "DeepSeek results keep MLA attention",
    ),
    Touch(
        "vllm.transformers_utils.model_arch_config_convertor",
        "ModelArchConfigConvertorBase",
        "subclassed by the MLA convertor",
        members=("is_deepseek_mla", "hf_text_config"),
    ),
    Touch(
        "vllm.config.speculative",
        "SpeculativeConfig",
        "MTP drafts: hf_config_override is wrapped",
        members=("hf_config_override",),
    ),
    Touch("vllm.config", "get_current_vllm_config", "the compilation registry of MoE layers"),
    Touch(
        "vllm.config.compilation",
        "CompilationConfig",
        "extra width-group runners are taken out",
        members=("static_forward_context", "static_all_moe_layers"),
    ),
    Touch("vllm.distributed", "get_tensor_model_parallel_world_size", "width rounded up to the TP size"),
    Touch(
        f"{_FUSED}.config",
        "RoutingMethodType",
        "GroupRouter asks for an unfused router",
        members=("Unspecified",),
    ),
    Touch(f"{_FUSED}.moe_output", "UnfinalizedMoEOutput", "a deferred MoE output is refused"),
    Touch(
        f"{_FUSED}.routed_experts",
        "RoutedExperts",
        "width-group blocks: run, loaded and read",
        members=(
            "forward_modular",
            "weight_loader",
            "quant_method",
            "ckpt_gate_proj_name",
            "ckpt_up_proj_name",
            "ckpt_down_proj_name",
            "_ensure_moe_quant_config_init",
        ),
    ),
    Touch(
        f"{_FUSED}.router.base_router",
        "BaseRouter",
        "GroupRouter's base",
        members=(
            "_compute_routing",
            "routing_method_type",
            "top_k",
            "global_num_experts",
            "capture_fn",
            "_routing_replay_out",
        ),
    ),
    Touch(
        f"{_FUSED}.router.router_factory",
        "create_fused_moe_router",
        "the family's router over all positions",
        params=(
            "top_k",
            "global_num_experts",
            "renormalize",
            "use_grouped_topk",
            "num_expert_group",
            "topk_group",
            "scoring_func",
            "routed_scaling_factor",
            "e_score_correction_bias",
            "num_logical_experts",
        ),
    ),
    Touch(
        f"{_FUSED}.runner.moe_runner",
        "MoERunner",
        "PrunedMoERunner's base",
        members=(
            "_apply_quant_method",
            "forward",
            "_maybe_apply_shared_experts",
            "moe_config",
            "router",
            "routed_experts",
            "_shared_experts",
            "shared_experts",
            "gate",
            "layer_name",
            "routed_input_transform",
            "routed_output_transform",
            "routed_scaling_factor",
        ),
    ),
    Touch(
        f"{_FUSED}.runner.shared_experts",
        "SharedExpertsOrder",
        "shared experts run first",
        members=("NO_OVERLAP",),
    ),
    Touch(
        f"{_FUSED}.config",
        "FusedMoEConfig",
        "read by PrunedMoERunner",
        members=("moe_parallel_config", "hidden_dim", "skip_final_all_reduce"),
    ),
    Touch(
        f"{_FUSED}.config",
        "FusedMoEParallelConfig",
        "novices added before or after the reduction",
        members=("tp_size", "dp_size", "ep_size", "pcp_size", "use_ep"),
    ),
    Touch(
        f"{_FUSED}.layer",
        "FusedMoEFactory",
        "swapped in the family's module while the model is built",
        params=FACTORY_PARAMS,
    ),
    Touch(
        f"{_FUSED}.router.gate_linear",
        "GateLinear",
        "swapped: one router row per position",
        params=("output_size", "prefix"),
    ),
)
