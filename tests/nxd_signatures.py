"""The signatures of the neuronx-distributed (NxD) and torch-xla functions and classes trnrecipes calls, or its
stand-ins copy, at every release the xla-nxd stack supports (Neuron SDK 2.21 to 2.28: trnrecipes/config/stacks.py).

Extracted with Python's ast from the public source, one version at a time (git show <commit>:<path>): the parameters
as written, `self` and annotations left out, defaults as source text; a class's row is its __init__. Each row holds
from the first to the last release it applies to, and where it was read (commit, line of the def). NxD paths are
under src/neuronx_distributed/ of aws-neuron/neuronx-distributed; torch-xla's are in pytorch/xla at the tags below.
Used by tests/test_nxd_signatures.py."""

from __future__ import annotations

from typing import NamedTuple

# NxD release -> (Neuron SDK, commit of aws-neuron/neuronx-distributed whose _version.py says it)
NXD_RELEASES = {
    "0.10": ("2.21", "58d27de (branch release_2.21.1, NxD 0.10.1)"),
    "0.11": ("2.22", "82a2bb3 (branch release_222)"),
    "0.12": ("2.23", "9148ac9 (branch release_2.23.0)"),
    "0.13": ("2.24", "dd06063 (branch release_2.24.0)"),
    "0.14": ("2.25", "c63420c (Neuron Release 2.25.0)"),
    "0.15": ("2.26", "fecfe75 (tag v2.26.0)"),
    "0.16": ("2.27", "47f695c (tag v2.27.0)"),
    "0.17": ("2.28", "73ab227 (Neuron SDK Release 2.28.0; tag v2.28.0 merges it unchanged for these files)"),
}
# torch-xla minor -> the pytorch/xla tag read (and its commit)
TORCH_XLA_RELEASES = {
    "2.5": "v2.5.1 (37e5fd2)",
    "2.6": "v2.6.0 (0bb4f6f)",
    "2.7": "v2.7.0 (d5871fc)",
    "2.8": "v2.8.0 (d517649)",
    "2.9": "v2.9.0 (5fab705)",
}
# What a pass-through signature hands its arguments to: NeuronZero1Optimizer(*args, **kwargs) calls torch-xla's
# ZeroRedundancyOptimizer.__init__ with them, whose **defaults go to optimizer_class (torch.optim.AdamW here).
FORWARDS = {
    "neuronx_distributed.optimizer.NeuronZero1Optimizer": (
        "torch_xla.distributed.zero_redundancy_optimizer.ZeroRedundancyOptimizer"
    ),
}


class Row(NamedTuple):
    first: str  # first release (NxD "0.10", torch-xla "2.5") this signature holds for
    last: str
    signature: str
    source: str


SIGNATURES: dict[str, list[Row]] = {
    "neuronx_distributed.kernels.flash_attn.nki_flash_attn_func": [
        Row(
            "0.10",
            "0.11",
            "(q, k, v, lnc=1, dropout_p=0.0, softmax_scale=None, causal=True, mixed_precision=True, seed=None, "
            "hardware_type=None)",
            "kernels/flash_attn.py: 58d27de, 82a2bb3 (tests/nki_standin.py)",
        ),
        Row(
            "0.12",
            "0.17",
            "(q, k, v, lnc=1, dropout_p=0.0, softmax_scale=None, causal=True, mixed_precision=True, seed=None, "
            "hardware_type=None, transpose_nki_inputs=True)",
            "kernels/flash_attn.py: 9148ac9, dd06063, c63420c, fecfe75, 47f695c, 73ab227 (tests/nki_standin.py)",
        ),
    ],
    "neuronx_distributed.parallel_layers.layers.ColumnParallelLinear": [
        Row(
            "0.10",
            "0.12",
            "(input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, device=None, "
            "stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None, "
            "keep_master_weight=False, skip_bias_add=False, pad=False, tensor_model_parallel_group=None, "
            "reduce_dtype=torch.float32)",
            "parallel_layers/layers.py: 58d27de L562, 82a2bb3 L528, 9148ac9 L530",
        ),
        Row(
            "0.13",
            "0.13",
            "(input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, device=None, "
            "stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None, "
            "keep_master_weight=False, skip_bias_add=False, pad=False, tensor_model_parallel_group=None, "
            "reduce_dtype=torch.float32, rank_ordering=None)",
            "parallel_layers/layers.py: dd06063 L539",
        ),
        Row(
            "0.14",
            "0.17",
            "(input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, device=None, "
            "stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None, "
            "keep_master_weight=False, skip_bias_add=False, pad=False, pad_alignment_size_per_rank=1, "
            "keep_padded_output=False, tensor_model_parallel_group=None, reduce_dtype=torch.float32, "
            "rank_ordering=None)",
            "parallel_layers/layers.py: c63420c L541, fecfe75 L563, 47f695c L588, 73ab227 L588",
        ),
    ],
    "neuronx_distributed.parallel_layers.layers.RowParallelLinear": [
        Row(
            "0.10",
            "0.12",
            "(input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32, device=None, "
            "stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None, "
            "keep_master_weight=False, skip_bias_add=False, pad=False, reduce_output=True, "
            "tensor_model_parallel_group=None, reduce_dtype=torch.float32)",
            "parallel_layers/layers.py: 58d27de L772, 82a2bb3 L760, 9148ac9 L762",
        ),
        Row(
            "0.13",
            "0.17",
            "(input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32, device=None, "
            "stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None, "
            "keep_master_weight=False, skip_bias_add=False, pad=False, reduce_output=True, "
            "tensor_model_parallel_group=None, reduce_dtype=torch.float32, tile_cc=False, rank_ordering=None)",
            "parallel_layers/layers.py: dd06063 L777, c63420c L799, fecfe75 L822, 47f695c L847, 73ab227 L847",
        ),
    ],
    "neuronx_distributed.parallel_layers.layers.ParallelEmbedding": [
        Row(
            "0.10",
            "0.10",
            "(num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0, "
            "scale_grad_by_freq=False, sparse=False, init_method=init.normal_, device=None, "
            "dtype=torch.float32, shard_across_embedding=False, pad=False, sequence_parallel_enabled=False, "
            "tensor_model_parallel_group=None, use_spmd_rank=False)",
            "parallel_layers/layers.py: 58d27de L160",
        ),
        Row(
            "0.11",
            "0.12",
            "(num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0, "
            "scale_grad_by_freq=False, sparse=False, init_method=init.normal_, device=None, "
            "dtype=torch.float32, shard_across_embedding=False, pad=False, sequence_parallel_enabled=False, "
            "tensor_model_parallel_group=None, use_spmd_rank=False, sequence_dimension=None)",
            "parallel_layers/layers.py: 82a2bb3 L167, 9148ac9 L167",
        ),
        Row(
            "0.13",
            "0.15",
            "(num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0, "
            "scale_grad_by_freq=False, sparse=False, init_method=init.normal_, device=None, "
            "dtype=torch.float32, shard_across_embedding=False, pad=False, sequence_parallel_enabled=False, "
            "tensor_model_parallel_group=None, use_spmd_rank=False, sequence_dimension=None, tile_cc=False, "
            "rank_ordering=None)",
            "parallel_layers/layers.py: dd06063 L170, c63420c L168, fecfe75 L189",
        ),
        Row(
            "0.16",
            "0.17",
            "(num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0, "
            "scale_grad_by_freq=False, sparse=False, init_method=init.normal_, device=None, "
            "dtype=torch.float32, shard_across_embedding=False, pad=False, sequence_parallel_enabled=False, "
            "tensor_model_parallel_group=None, use_spmd_rank=False, sequence_dimension=None, tile_cc=False, "
            "rank_ordering=None, collect_output=True)",
            "parallel_layers/layers.py: 47f695c L205, 73ab227 L205",
        ),
    ],
    "neuronx_distributed.parallel_layers.layers._initialize_parameter_cpu": [
        Row(
            "0.10",
            "0.17",
            "(param, partition_dim, num_partitions, init_method, return_master_param=False, *, "
            "param_dtype=torch.float32, stride=1)",
            "parallel_layers/layers.py: 58d27de L102, 82a2bb3 L109, 9148ac9 L109, "
            "dd06063 L110, c63420c L108, fecfe75 L110, 47f695c L112, 73ab227 L112",
        ),
    ],
    "neuronx_distributed.modules.qkv_linear.GQAQKVColumnParallelLinear": [
        Row(
            "0.10",
            "0.17",
            "(input_size, output_sizes, bias=True, gather_output=True, dtype=torch.float32, device=None, "
            "init_method=None, sequence_parallel_enabled=False, keep_master_weight=False, "
            "kv_size_multiplier=1, fuse_qkv=True, reduce_dtype=torch.float32)",
            "modules/qkv_linear.py: 58d27de L511, 82a2bb3 L420, 9148ac9 L420, dd06063"
            " L420, c63420c L420, fecfe75 L420, 47f695c L420, 73ab227 L420",
        ),
    ],
    "neuronx_distributed.modules.qkv_linear._initialize_affine_weight": [
        Row(
            "0.10",
            "0.17",
            "(weight, output_size, input_size, per_partition_size, partition_dim, init_method, "
            "return_master_weight=False, *, params_dtype=torch.float32, stride=1, tp_size_multiplier=1, "
            "device=None)",
            "modules/qkv_linear.py: 58d27de L38, 82a2bb3 L45, 9148ac9 L45, dd06063 "
            "L45, c63420c L45, fecfe75 L45, 47f695c L45, 73ab227 L45",
        ),
    ],
    "neuronx_distributed.parallel_layers.mappings.scatter_to_sequence_parallel_region": [
        Row(
            "0.10",
            "0.17",
            "(input_, sequence_dimension=0, process_group=None)",
            "parallel_layers/mappings.py: 58d27de L421, 82a2bb3 L425, 9148ac9 L428, "
            "dd06063 L547, c63420c L547, fecfe75 L547, 47f695c L547, 73ab227 L547",
        ),
    ],
    "neuronx_distributed.parallel_layers.mappings.gather_from_sequence_parallel_region": [
        Row(
            "0.10",
            "0.12",
            "(input_, sequence_dimension=0, to_model_parallel=True, process_group=None)",
            "parallel_layers/mappings.py: 58d27de L429, 82a2bb3 L433, 9148ac9 L436",
        ),
        Row(
            "0.13",
            "0.17",
            "(input_, sequence_dimension=0, to_model_parallel=True, process_group=None, tile_cc=False)",
            "parallel_layers/mappings.py: dd06063 L555, c63420c L555, fecfe75 L555, 47f695c L555, 73ab227 L555",
        ),
    ],
    "neuronx_distributed.parallel_layers.loss_functions.parallel_cross_entropy": [
        Row(
            "0.10",
            "0.17",
            "(vocab_parallel_logits, target, label_smoothing=0.0)",
            "parallel_layers/loss_functions.py (the same file at all eight): 58d27de L217, 82a2bb3 L217, "
            "9148ac9 L217, dd06063 L217, c63420c L217, fecfe75 L217, 47f695c L217, 73ab227 L217",
        ),
    ],
    "neuronx_distributed.parallel_layers.mappings.reduce_from_tensor_model_parallel_region": [
        Row(
            "0.10",
            "0.17",
            "(input_, process_group=None)",
            "parallel_layers/mappings.py: 58d27de L403, 82a2bb3 L403, 9148ac9 L406, "
            "dd06063 L525, c63420c L525, fecfe75 L525, 47f695c L525, 73ab227 L525",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel": [
        Row(
            "0.10",
            "0.10",
            "(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1, "
            "skip_collective_init=False, lnc_size=1)",
            "parallel_layers/parallel_state.py: 58d27de L311",
        ),
        Row(
            "0.11",
            "0.14",
            "(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1, "
            "expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1)",
            "parallel_layers/parallel_state.py: 82a2bb3 L343, 9148ac9 L347, dd06063 L383, c63420c L383",
        ),
        Row(
            "0.15",
            "0.17",
            "(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1, "
            "expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1, mesh_only=False)",
            "parallel_layers/parallel_state.py: fecfe75 L383, 47f695c L383, 73ab227 L391",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.model_parallel_is_initialized": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L686, 82a2bb3 L774, 9148ac9 "
            "L778, dd06063 L814, c63420c L814, fecfe75 L818, 47f695c L818, 73ab227 L826",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_tensor_model_parallel_size": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L755, 82a2bb3 L843, 9148ac9 "
            "L847, dd06063 L883, c63420c L883, fecfe75 L887, 47f695c L887, 73ab227 L895",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_tensor_model_parallel_rank": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L778, 82a2bb3 L866, 9148ac9 "
            "L870, dd06063 L906, c63420c L906, fecfe75 L910, 47f695c L910, 73ab227 L918",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_data_parallel_size": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L844, 82a2bb3 L932, 9148ac9 "
            "L936, dd06063 L1017, c63420c L1017, fecfe75 L1021, 47f695c L1029, 73ab227 L1037",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_data_parallel_rank": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L851, 82a2bb3 L939, 9148ac9 "
            "L943, dd06063 L1024, c63420c L1024, fecfe75 L1028, 47f695c L1036, 73ab227 L1044",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_data_parallel_replica_groups": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L735, 82a2bb3 L823, 9148ac9 "
            "L827, dd06063 L863, c63420c L863, fecfe75 L867, 47f695c L867, 73ab227 L875",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_tensor_model_parallel_replica_groups": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L707, 82a2bb3 L795, 9148ac9 "
            "L799, dd06063 L835, c63420c L835, fecfe75 L839, 47f695c L839, 73ab227 L847",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_pipeline_model_parallel_size": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L947, 82a2bb3 L1035, 9148ac9 "
            "L1039, dd06063 L1120, c63420c L1120, fecfe75 L1124, 47f695c L1132, 73ab227 L1140",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_pipeline_model_parallel_rank": [
        Row(
            "0.10",
            "0.17",
            "()",
            "parallel_layers/parallel_state.py: 58d27de L902, 82a2bb3 L990, 9148ac9 "
            "L994, dd06063 L1075, c63420c L1075, fecfe75 L1079, 47f695c L1087, 73ab227 L1095",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_pipeline_model_parallel_group": [
        Row(
            "0.10",
            "0.17",
            "(as_list=False)",
            "parallel_layers/parallel_state.py: 58d27de L888, 82a2bb3 L976, 9148ac9 "
            "L980, dd06063 L1061, c63420c L1061, fecfe75 L1065, 47f695c L1073, 73ab227 L1081",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.initialize_kv_group": [
        Row(
            "0.10",
            "0.17",
            "(kv_shared_group_size=1, sequential_ranks_in_group=False)",
            "parallel_layers/parallel_state.py: 58d27de L1227, 82a2bb3 L1368, 9148ac9"
            " L1372, dd06063 L1453, c63420c L1453, fecfe75 L1457, 47f695c L1465, 73ab227 L1473",
        ),
    ],
    "neuronx_distributed.parallel_layers.parallel_state.get_kv_shared_group": [
        Row(
            "0.10",
            "0.17",
            "(as_list=False)",
            "parallel_layers/parallel_state.py: 58d27de L1258, 82a2bb3 L1399, 9148ac9"
            " L1403, dd06063 L1484, c63420c L1484, fecfe75 L1488, 47f695c L1496, 73ab227 L1504",
        ),
    ],
    "neuronx_distributed.parallel_layers.utils.set_tensor_model_parallel_attributes": [
        Row(
            "0.10",
            "0.12",
            "(tensor, is_parallel, dim, stride, num_partitions=-1)",
            "parallel_layers/utils.py: 58d27de L51, 82a2bb3 L51, 9148ac9 L51",
        ),
        Row(
            "0.13",
            "0.17",
            "(tensor, is_parallel, dim, stride, num_partitions=-1, rank_ordering=None)",
            "parallel_layers/utils.py: dd06063 L52, c63420c L52, fecfe75 L55, 47f695c L55, 73ab227 L55",
        ),
    ],
    "neuronx_distributed.parallel_layers.grads.bucket_allreduce_gradients": [
        Row(
            "0.10",
            "0.17",
            "(grads_list, reduce_over_ep_group=False)",
            "parallel_layers/grads.py: 58d27de L256, 82a2bb3 L259, 9148ac9 L259, "
            "dd06063 L259, c63420c L259, fecfe75 L259, 47f695c L259, 73ab227 L259",
        ),
    ],
    "neuronx_distributed.parallel_layers.grads.clip_grad_norm": [
        Row(
            "0.10",
            "0.17",
            "(parameters, max_norm, norm_type=2, zero1_optimizer=False, zero1_optimizer_groups=None, force_spmd=True)",
            "parallel_layers/grads.py: 58d27de L189, 82a2bb3 L192, 9148ac9 L192, "
            "dd06063 L192, c63420c L192, fecfe75 L192, 47f695c L192, 73ab227 L192",
        ),
    ],
    "neuronx_distributed.utils.model_utils.move_model_to_device": [
        Row(
            "0.10",
            "0.17",
            "(model, device)",
            "utils/model_utils.py: 58d27de L228, 82a2bb3 L228, 9148ac9 L228, dd06063 "
            "L231, c63420c L232, fecfe75 L232, 47f695c L232, 73ab227 L232",
        ),
    ],
    "neuronx_distributed.optimizer.NeuronZero1Optimizer": [
        Row(
            "0.10",
            "0.17",
            "(*args, **kwargs)",
            "optimizer/zero_redundancy_optimizer.py: 58d27de L30, 82a2bb3 L30, "
            "9148ac9 L30, dd06063 L31, c63420c L31, fecfe75 L31, 47f695c L31, 73ab227 L31",
        ),
    ],
    "neuronx_distributed.pipeline.NxDPPModel": [
        Row(
            "0.10",
            "0.10",
            "(module, transformer_layer_cls=None, num_microbatches=1, virtual_pipeline_size=1, "
            "output_loss_value_spec=None, return_mb_loss=False, broadcast_and_average_loss=False, "
            "use_zero1_optimizer=False, use_model_wrapper=False, use_optimizer_wrapper=False, "
            "pipeline_cuts=None, input_names=None, leaf_module_cls=None, autowrap_functions=None, "
            "autowrap_modules=None, autowrap_obj_methods=None, tracer_cls=None, param_init_fn=None, "
            "trace_file_path=None, return_loss_on_cpu=True, deallocate_pipeline_outputs=False, "
            "auto_partition=False, fuse_microbatches=False, _delay_tracing=False, "
            "_turn_off_odd_even_scheduler=False, _all_reduce_send_recv=False, _fused_send_recv=False, "
            "_fused_fwd_bwd=False, _mark_step_before_pp_runtime=True, _mark_step_after_pp_runtime=True, "
            "_deallocate_send_tensors=True, _use_gloo_for_metadata_comm=False, _debug_mode=False, "
            "_debug_pp_size=8, _debug_pp_rank=0)",
            "pipeline/model.py: 58d27de L62",
        ),
        Row(
            "0.11",
            "0.17",
            "(module, transformer_layer_cls=None, num_microbatches=1, virtual_pipeline_size=1, "
            "output_loss_value_spec=None, return_mb_loss=False, broadcast_and_average_loss=False, "
            "use_zero1_optimizer=False, use_model_wrapper=False, use_optimizer_wrapper=False, "
            "pipeline_cuts=None, input_names=None, leaf_module_cls=None, autowrap_functions=None, "
            "autowrap_modules=None, autowrap_obj_methods=None, tracer_cls=None, param_init_fn=None, "
            "trace_file_path=None, return_loss_on_cpu=True, deallocate_pipeline_outputs=False, "
            "auto_partition=False, fuse_microbatches=False, manual_pp_partition=False, "
            "manual_pp_stage_partition_fn=None, manual_pp_loss_fn=None, _delay_tracing=False, "
            "_turn_off_odd_even_scheduler=False, _all_reduce_send_recv=False, _fused_send_recv=False, "
            "_fused_fwd_bwd=False, _mark_step_before_pp_runtime=True, _mark_step_after_pp_runtime=True, "
            "_deallocate_send_tensors=True, _use_gloo_for_metadata_comm=False, _debug_mode=False, "
            "_debug_pp_size=8, _debug_pp_rank=0)",
            "pipeline/model.py: 82a2bb3 L81, 9148ac9 L81, dd06063 L81, c63420c L81, "
            "fecfe75 L75, 47f695c L75, 73ab227 L75",
        ),
    ],
    "neuronx_distributed.pipeline.NxDPPModel.run_train": [
        Row(
            "0.10",
            "0.17",
            "(*args, **kwargs)",
            "pipeline/model.py: 58d27de L793, 82a2bb3 L977, 9148ac9 L977, dd06063 "
            "L977, c63420c L977, fecfe75 L968, 47f695c L968, 73ab227 L968",
        ),
    ],
    "neuronx_distributed.pipeline.NxDPPModel.run_eval": [
        Row(
            "0.10",
            "0.10",
            "(**kwargs)",
            "pipeline/model.py: 58d27de L810",
        ),
        Row(
            "0.11",
            "0.17",
            "(*args, **kwargs)",
            "pipeline/model.py: 82a2bb3 L994, 9148ac9 L994, dd06063 L994, c63420c "
            "L994, fecfe75 L985, 47f695c L985, 73ab227 L985",
        ),
    ],
    "torch_xla.device": [
        Row(
            "2.5",
            "2.9",
            "(index=None)",
            "torch_xla/torch_xla.py: 37e5fd2 L19, 0bb4f6f L19, d5871fc L19, d517649 L19, 5fab705 L19",
        ),
    ],
    "torch_xla.sync": [
        Row(
            "2.5",
            "2.7",
            "(wait=False)",
            "torch_xla/torch_xla.py: 37e5fd2 L62, 0bb4f6f L62, d5871fc L62",
        ),
        Row(
            "2.8",
            "2.9",
            "(wait=False, reset_scope=True)",
            "torch_xla/torch_xla.py: d517649 L78, 5fab705 L78",
        ),
    ],
    "torch_xla.core.xla_model.set_rng_state": [
        Row(
            "2.5",
            "2.9",
            "(seed, device=None)",
            "torch_xla/core/xla_model.py: 37e5fd2 L1461, 0bb4f6f L1491, d5871fc L1481, d517649 L1456, 5fab705 L1453",
        ),
    ],
    "torch_xla.distributed.parallel_loader.MpDeviceLoader": [
        Row(
            "2.5",
            "2.9",
            "(loader, device, **kwargs)",
            "torch_xla/distributed/parallel_loader.py: 37e5fd2 L256, 0bb4f6f L272, d5871fc L272, d517649 "
            "L272, 5fab705 L272",
        ),
    ],
    "torch_xla.debug.metrics.counter_value": [
        Row(
            "2.5",
            "2.9",
            "(name)",
            "torch_xla/debug/metrics.py: 37e5fd2 L9, 0bb4f6f L9, d5871fc L9, d517649 L9, 5fab705 L9",
        ),
    ],
    "torch_xla.distributed.zero_redundancy_optimizer.ZeroRedundancyOptimizer": [
        Row(
            "2.5",
            "2.9",
            "(params, optimizer_class, optimizer_dtype=None, grad_clipping=True, max_norm=None, "
            "pin_layout=True, sharding_groups=None, grad_norm_groups=None, lazy_init=False, "
            "bucket_cap_mb_all_gather=0, bucket_cap_mb_reduce_scatter=0, use_grad_acc_hook=False, "
            "save_master_weights=False, higher_cc_precision=False, **defaults)",
            "torch_xla/distributed/zero_redundancy_optimizer.py: 37e5fd2 L68, 0bb4f6f L68, d5871fc L68, "
            "d517649 L68, 5fab705 L68",
        ),
    ],
}
