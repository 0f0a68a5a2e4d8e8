"""The tensor-parallel split of the tiny model.py's state dict into one rank's
``model{rank}-mp{world}.safetensors`` shard, as DeepSeek's convert.py lays a real
checkpoint out (written for the tiny model's names; used by tests/test_generate.py
and benchmarks/bench_generate.py): column-parallel output rows (``wq_b``), row-parallel
input columns (``wo``), vocabulary rows (``embed.weight``, ``head``), the heads' sinks,
and whole routed experts per rank (the other ranks' experts dropped)."""


def shard(state, rank, world, n_experts):
    """state: {name: tensor} of the whole model -> {name: tensor} of rank's shard."""
    n_local = n_experts // world
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if "experts" in parts and "shared_experts" not in parts:
            if int(parts[parts.index("experts") + 1]) // n_local == rank:
                out[k] = v
            continue
        dim = None
        if k in ("embed.weight", "head") or ".wq_b." in k or k.endswith("attn_sink"):
            dim = 0
        elif ".wo." in k:
            dim = 1
        if dim is None or world == 1:
            out[k] = v
        else:
            n = v.shape[dim] // world
            out[k] = v.narrow(dim, rank * n, n).contiguous()
    return out
