"""Data-parallel training of a swapped transformers DeepseekV4 model across processes.

Every rank builds the same model (same seed), routes its attention through
deepseek_csa (``deepseek_csa.transformers.swap``), wraps it in
``torch.nn.parallel.DistributedDataParallel`` over gloo (the CPU backend) and trains on
its share of each global batch: rank r takes rows r, r + W, r + 2W, ... of the batch.
DDP averages the gradients across ranks, which is the gradient of the mean loss over the
whole batch, so W ranks take the steps one process takes on the whole batch.

    # one machine, two processes of one thread each
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/train_ddp.py --steps 10
    # the same run in one process (the reference the test compares with)
    OMP_NUM_THREADS=2 python examples/train_ddp.py --steps 10
    # several machines: the same command on each, with its --node-rank
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \
        --master-addr HOST0 --master-port 29500 examples/train_ddp.py

Rank 0 prints one line per step, ``step k loss L``, the global batch's mean loss.
``--dump-grads PATH`` saves the gradients of the first step (after DDP's all-reduce) as
a .pt file of {name: tensor}; ``--tiny`` / the model flags set the model's size.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def build_model(layers, hidden, seed):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    types = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention",
             "window": "sliding_attention"}
    kinds = [types[k] for k in layers.split(",")]
    cfg = DeepseekV4Config(
        vocab_size=97, hidden_size=hidden, num_hidden_layers=len(kinds), num_attention_heads=4,
        head_dim=32, partial_rotary_factor=8 / 32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        layer_types=kinds, mlp_layer_types=["moe"] * len(kinds),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=16, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=8, index_head_dim=16,
        index_topk=5, num_nextn_predict_layers=0, max_position_embeddings=512)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():      # the model starts sinks and position biases at zero
        for name, p in model.named_parameters():
            if name.endswith("position_bias") or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="global batch (rows), split over ranks")
    ap.add_argument("--seq", type=int, default=40, help="tokens per row")
    ap.add_argument("--layers", default="hca,csa,window,csa", help="layer kinds, comma-separated")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump-grads", default=None, help="save step 1's gradients here (.pt)")
    a = ap.parse_args(argv)

    import deepseek_csa.transformers as dch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch} must be a multiple of the {world} ranks")
    distributed = world > 1
    if distributed:
        torch.distributed.init_process_group("gloo")

    model = build_model(a.layers, a.hidden, a.seed)
    dch.swap(model)
    model.train()
    # unused parameters: the indexer's (its top-k selection passes no gradient to the
    # LM loss; capture_indexer trains it) and, per rank, the experts no token chose
    net = (torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
           if distributed else model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    data = torch.Generator().manual_seed(a.seed + 7)

    for step in range(1, a.steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), generator=data)
        mine = ids[rank::world]
        opt.zero_grad(set_to_none=True)
        loss = net(mine, labels=mine, use_cache=False).loss
        loss.backward()
        if step == 1 and a.dump_grads and rank == 0:
            torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters()
                        if p.grad is not None}, a.dump_grads)
        opt.step()
        shown = loss.detach().clone()
        if distributed:          # the global batch's mean (equal shares per rank)
            torch.distributed.all_reduce(shown)
            shown /= world
        if rank == 0:
            print(f"step {step} loss {shown.item():.6f}", flush=True)

    if distributed:
        torch.distributed.destroy_process_group()
        # Leave without the interpreter's shutdown.  gloo's worker threads free each
        # finished collective's tensors after the caller has its result, and freeing a
        # tensor Python has seen takes the GIL: a worker that gets there while the
        # interpreter shuts down dies inside a C++ destructor and the rank aborts
        # ("terminate called without an active exception"; 1 run in 6 on 2 busy cores,
        # with or without a final barrier).  destroy_process_group does not join them
        # while DDP's autograd hooks still hold the group.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
