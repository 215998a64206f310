"""Stand-ins for neuronx-distributed's parallel layers (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding,
GQAQKVColumnParallelLinear) at NxD 0.17 (Neuron SDK 2.28; aws-neuron/neuronx-distributed 73ab227,
src/neuronx_distributed/parallel_layers/layers.py and modules/qkv_linear.py): their constructors keyword for keyword
(tests/nxd_signatures.py holds the real ones), the shard each allocates, the attributes NxD sets on it, and the
device handling that decides whether a layer runs its host init, which allocates the whole unsharded weight:
- Column/RowParallelLinear: the weight goes on `device`, None meaning the ambient default device; a cpu weight runs
  init_weight_cpu (_initialize_parameter_cpu: the full fp32 master, its downcast copy, this rank's slice copied
  out), a meta weight is only tagged. The bias follows the weight's device.
- ParallelEmbedding: for device None, cpu or meta it allocates with no device argument, so the ambient device
  decides: device=meta alone still allocates on the host and runs the init; only an ambient meta device skips it.
- GQAQKVColumnParallelLinear: q, k, v each run _initialize_affine_weight (the full fp32 master, k/v repeated
  kv_size_multiplier times in trn1's tiled order, the downcast) unless the weight is on meta; the fused weight is
  then re-made by torch.cat, untagged.
HostMasters records what those inits allocate. The forward is the local shard's linear map (no collectives)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn import init

NXD_VERSION = "0.17"  # what the stand-ins copy (tests/test_nxd_signatures.py checks them against the table)


class HostMasters:
    """The full (unsharded) tensors NxD's host init allocates. Per call: the fp32 master, and the copies made from it
    (the repeated k/v, the downcast; `.to` of the same dtype is the master itself), all freed when the call returns,
    but for the one a layer keeps (keep_master_weight)."""

    def __init__(self) -> None:
        self.masters: list[tuple[int, ...]] = []  # the full shape of every fp32 master, in allocation order
        self.master_bytes = 0  # the fp32 masters' bytes, summed over the build
        self.peak_bytes = 0  # the most bytes of full-size tensors alive at one time
        self._kept = 0

    def allocate(self, master: torch.Tensor, *copies: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        alive = {id(t): t.numel() * t.element_size() for t in (master, *copies)}
        self.masters.append(tuple(master.shape))
        self.master_bytes += alive[id(master)]
        self.peak_bytes = max(self.peak_bytes, self._kept + sum(alive.values()))
        self._kept += 0 if kept is None else kept.numel() * kept.element_size()


def layer_modules(tp: int, rank: int, built: list[dict], host: HostMasters, state) -> dict[str, dict]:
    """The attributes of the stand-in modules neuronx_distributed.parallel_layers.layers and .modules.qkv_linear, for
    TP rank `rank` of `tp`. `built` gets one record per layer built (its arguments, its weight's device); `state` is
    the stand-in parallel_state (set_tensor_model_parallel_attributes, initialize_kv_group)."""
    tag = state.set_tensor_model_parallel_attributes

    def local_slice(full: torch.Tensor, weight: torch.Tensor, partition_dim: int, size: int, stride: int) -> None:
        """create_local_weight: this rank's `size` rows (or columns) of the full tensor into `weight`."""
        if stride != 1:
            raise NotImplementedError(f"stride {stride}: the stand-in slices stride-1 weights only")
        with torch.no_grad():
            weight.copy_(full.split(size, dim=partition_dim)[rank])

    def _initialize_parameter_cpu(param, partition_dim, num_partitions, init_method, return_master_param=False, *,
                                  param_dtype=torch.float32, stride=1):  # fmt: skip
        tag(tensor=param, is_parallel=True, dim=partition_dim, stride=stride, num_partitions=num_partitions)
        master_shape = list(param.shape)
        master_shape[partition_dim] *= tp
        master = nn.Parameter(torch.empty(master_shape, dtype=torch.float32, requires_grad=False))
        init_method(master)
        master_weight = master.to(dtype=param_dtype)
        host.allocate(master, master_weight, kept=master_weight if return_master_param else None)
        local_slice(master_weight, param, partition_dim, param.shape[partition_dim], stride)
        return master_weight if return_master_param else None

    def _initialize_affine_weight(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                                  return_master_weight=False, *, params_dtype=torch.float32, stride=1,
                                  tp_size_multiplier=1, device=None):  # fmt: skip
        tag(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride, num_partitions=tp)
        full = torch.empty(output_size, input_size, dtype=torch.float, requires_grad=False, device=device)
        master = nn.Parameter(full)
        init_method(master)
        repeated = master.repeat(tp_size_multiplier, 1)  # trn1: (K0, K1, ...) repeated; trn2 repeat_interleaves
        downcast = repeated.to(dtype=params_dtype)
        host.allocate(master, repeated, downcast, kept=master if return_master_weight else None)
        local_slice(downcast, weight, partition_dim, per_partition_size, stride)
        return master if return_master_weight else None

    class _ParallelLinear(nn.Module):
        """BaseParallelLinear and the initialize_weight_and_bias both layers share (layers.py 73ab227 L674-700)."""

        def _allocate(self, weight_shape, partition_dim, bias_shape, device, rank_ordering) -> None:
            self.weight_partition_dim = partition_dim
            self.weight = nn.Parameter(torch.empty(*weight_shape, device=device, dtype=self.dtype))
            self.device = self.weight.device
            if self.device.type == "cpu":
                self.init_weight_cpu()
            elif self.device.type == "meta":
                tag(tensor=self.weight, is_parallel=True, dim=partition_dim, stride=self.stride, num_partitions=tp,
                    rank_ordering=rank_ordering)  # fmt: skip
            else:
                raise NotImplementedError("an XLA weight (_initialize_affine_weight_neuron) is not modelled")
            if bias_shape is None:
                self.register_parameter("bias", None)
                return
            on = {} if self.device.type == "cpu" else {"device": self.device}
            self.bias = nn.Parameter(torch.empty(*bias_shape, dtype=self.dtype, **on))
            if self.bias.device != torch.device("meta"):
                self._init_bias()

        def init_weight_cpu(self) -> None:
            self.master_weight = _initialize_parameter_cpu(
                param=self.weight, partition_dim=self.weight_partition_dim, num_partitions=tp,
                init_method=self._init_weight, param_dtype=self.dtype, stride=self.stride,
                return_master_param=self.keep_master_weight,
            )  # fmt: skip

        def _init_weight(self, weight: torch.Tensor) -> None:
            if self.arg_init_method is None:
                init.kaiming_uniform_(weight, a=math.sqrt(5))
            else:
                self.arg_init_method(weight)

        def _init_bias(self) -> None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

        def _options(self, dtype, init_method, stride, keep_master_weight, pad, skip_bias_add) -> None:
            if pad or skip_bias_add:
                raise NotImplementedError("pad / skip_bias_add are not modelled")
            self.dtype, self.arg_init_method, self.stride = dtype, init_method, stride
            self.keep_master_weight = keep_master_weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight, self.bias)

    class ColumnParallelLinear(_ParallelLinear):
        def __init__(self, input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, device=None,
                     stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None,
                     keep_master_weight=False, skip_bias_add=False, pad=False, pad_alignment_size_per_rank=1,
                     keep_padded_output=False, tensor_model_parallel_group=None, reduce_dtype=torch.float32,
                     rank_ordering=None):  # fmt: skip
            super().__init__()
            self._options(dtype, init_method, stride, keep_master_weight, pad, skip_bias_add)
            bias_shape = ((output_size if gather_output else output_size // tp),) if bias else None
            self._allocate((output_size // tp, input_size), 0, bias_shape, device, rank_ordering)
            if bias and not gather_output:
                tag(self.bias, True, dim=0, stride=stride, num_partitions=tp, rank_ordering=rank_ordering)
            built.append({"layer": "ColumnParallelLinear", "dtype": dtype, "reduce_dtype": reduce_dtype,
                          "init_method": init_method, "sp": (sequence_parallel_enabled, sequence_dimension),
                          "gather_output": gather_output, "weight_device": self.weight.device.type})  # fmt: skip

    class RowParallelLinear(_ParallelLinear):
        def __init__(self, input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32,
                     device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
                     sequence_dimension=None, keep_master_weight=False, skip_bias_add=False, pad=False,
                     reduce_output=True, tensor_model_parallel_group=None, reduce_dtype=torch.float32, tile_cc=False,
                     rank_ordering=None):  # fmt: skip
            super().__init__()
            if sequence_parallel_enabled and not input_is_parallel:
                raise RuntimeError("To enable `sequence_parallel_enabled`, `input_is_parallel` must be `True`")
            self._options(dtype, init_method, stride, keep_master_weight, pad, skip_bias_add)
            self._allocate((output_size, input_size // tp), 1, (output_size,) if bias else None, device, rank_ordering)
            if bias:
                self.bias.sequence_parallel_enabled = sequence_parallel_enabled
            built.append({"layer": "RowParallelLinear", "dtype": dtype, "reduce_dtype": reduce_dtype,
                          "init_method": init_method, "sp": (sequence_parallel_enabled, sequence_dimension),
                          "input_is_parallel": input_is_parallel,
                          "weight_device": self.weight.device.type})  # fmt: skip

    class ParallelEmbedding(nn.Module):
        def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                     scale_grad_by_freq=False, sparse=False, init_method=init.normal_, device=None,
                     dtype=torch.float32, shard_across_embedding=False, pad=False, sequence_parallel_enabled=False,
                     tensor_model_parallel_group=None, use_spmd_rank=False, sequence_dimension=None, tile_cc=False,
                     rank_ordering=None, collect_output=True):  # fmt: skip
            super().__init__()
            if shard_across_embedding or pad or padding_idx is not None:
                raise NotImplementedError("shard_across_embedding / pad / padding_idx are not modelled")
            self.init_method, self.dtype = init_method, dtype
            if device is None or device.type in ("cpu", "meta"):
                self.weight = nn.Parameter(torch.empty(num_embeddings // tp, embedding_dim, dtype=dtype))  # no device
                if self.weight.device != torch.device("meta"):
                    self.init_weight_cpu()
                else:
                    tag(tensor=self.weight, is_parallel=True, dim=0, stride=1, num_partitions=tp,
                        rank_ordering=rank_ordering)  # fmt: skip
            else:
                raise NotImplementedError("an XLA weight (_initialize_affine_weight_neuron) is not modelled")
            built.append({"layer": "ParallelEmbedding", "dtype": dtype, "init_method": init_method,
                          "weight_device": self.weight.device.type})  # fmt: skip

        def init_weight_cpu(self) -> None:
            _initialize_parameter_cpu(param=self.weight, partition_dim=0, num_partitions=tp,
                                      init_method=self.init_method, param_dtype=self.dtype)  # fmt: skip

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return F.embedding(ids, self.weight)

    class GQAQKVColumnParallelLinear(nn.Module):
        """Fused q/k/v only (fuse_qkv), no bias: what trnrecipes builds. Local sizes: q output_sizes[0] / tp rows,
        k and v output_sizes[1] * kv_size_multiplier / tp each, in one fused weight_qkv [q | k | v]."""

        def __init__(self, input_size, output_sizes, bias=True, gather_output=True, dtype=torch.float32, device=None,
                     init_method=None, sequence_parallel_enabled=False, keep_master_weight=False,
                     kv_size_multiplier=1, fuse_qkv=True, reduce_dtype=torch.float32):  # fmt: skip
            super().__init__()
            if bias or not fuse_qkv:
                raise NotImplementedError("a bias or unfused q/k/v weights are not modelled")
            assert tp % kv_size_multiplier == 0 and (output_sizes[1] * kv_size_multiplier) % tp == 0
            state.initialize_kv_group(kv_size_multiplier)
            self.input_size, self.output_sizes, self.kv_size_multiplier = input_size, output_sizes, kv_size_multiplier
            self.arg_init_method, self.dtype, self.keep_master_weight = init_method, dtype, keep_master_weight
            self.q_out, self.kv_out = output_sizes[0] // tp, output_sizes[1] * kv_size_multiplier // tp
            rows = self.q_out + 2 * self.kv_out
            self.weight_qkv = nn.Parameter(torch.empty(rows, input_size, dtype=dtype, device=device))
            self.register_parameter("bias_qkv", None)
            self.initialize_weight_biases()
            built.append({"layer": "GQAQKVColumnParallelLinear", "dtype": dtype, "reduce_dtype": reduce_dtype,
                          "init_method": init_method, "output_sizes": output_sizes, "bias": bias,
                          "gather_output": gather_output, "kv_size_multiplier": kv_size_multiplier,
                          "fuse_qkv": fuse_qkv, "sp": (sequence_parallel_enabled, None),
                          "weight_device": self.weight_qkv.device.type})  # fmt: skip

        def initialize_weight_biases(self) -> None:
            q, k, v = torch.split(self.weight_qkv, [self.q_out, self.kv_out, self.kv_out], dim=0)
            self._init_per_layer_weight(q, self.output_sizes[0], self.q_out, 1)
            self._init_per_layer_weight(k, self.output_sizes[1], self.kv_out, self.kv_size_multiplier)
            self._init_per_layer_weight(v, self.output_sizes[1], self.kv_out, self.kv_size_multiplier)
            with torch.no_grad():
                self.weight_qkv = nn.Parameter(torch.cat([q, k, v], dim=0))  # untagged

        def _init_per_layer_weight(self, weight, output_size, output_size_per_partition, kv_size_multiplier=1):
            if weight.device == torch.device("meta"):
                return None
            return _initialize_affine_weight(
                weight, output_size, self.input_size, output_size_per_partition, 0, self._init_weight,
                params_dtype=self.dtype, return_master_weight=self.keep_master_weight,
                tp_size_multiplier=kv_size_multiplier,
            )  # fmt: skip

        def _init_weight(self, weight: torch.Tensor) -> None:
            if self.arg_init_method is None:
                init.kaiming_uniform_(weight, a=math.sqrt(5))
            else:
                self.arg_init_method(weight)

        def forward(self, x):
            return F.linear(x, self.weight_qkv).split([self.q_out, self.kv_out, self.kv_out], -1)

    return {
        "neuronx_distributed.parallel_layers.layers": dict(
            ColumnParallelLinear=ColumnParallelLinear,
            RowParallelLinear=RowParallelLinear,
            ParallelEmbedding=ParallelEmbedding,
            _initialize_parameter_cpu=_initialize_parameter_cpu,
            host_masters=host,
        ),
        "neuronx_distributed.modules.qkv_linear": dict(
            GQAQKVColumnParallelLinear=GQAQKVColumnParallelLinear,
            _initialize_affine_weight=_initialize_affine_weight,
        ),
    }
