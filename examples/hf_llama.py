"""A Hugging Face ``transformers`` causal LM (a small LlamaForCausalLM built from a config: nothing is downloaded)
trained through meshrun.Session with FSDP2 or tensor parallelism, checkpointed and resumed at another world size.

Needs the optional extra: ``pip install -e ".[hf]"`` (transformers). Byte-level text of a few Python standard
library files is the data. For example:

    python examples/hf_llama.py --steps 10 --ckpt ckpt_llama                         # one process, steps 1-10
    meshrun launch --nproc-per-node 2 examples/hf_llama.py --layout fsdp --steps 20 --ckpt ckpt_llama  # 11-20
    meshrun launch --nproc-per-node 2 examples/hf_llama.py --layout tp --steps 30 --ckpt ckpt_llama    # 21-30
    meshrun ckpt ls ckpt_llama && meshrun ckpt export ckpt_llama/step_0000030 --to llama.safetensors

Each run resumes from the newest checkpoint in --ckpt, whatever layout and world size saved it (same global
batch, so the data order continues exactly). FSDP2 shards each LlamaDecoderLayer (found: ``model.layers``); TP
follows the model's own plan (``config.base_model_tp_plan``: q/k/v/gate/up column-parallel, o/down row-parallel).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import meshrun
from meshrun.data.sampler import TokenWindows

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover - the message is the point
    sys.exit('this example needs transformers: pip install -e ".[hf]"')


def text_bytes() -> np.ndarray:
    """Byte-level tokens (0..255) of a few standard-library modules: the same bytes on every machine."""
    import json as json_module
    import textwrap

    files = [Path(json_module.__file__).with_name("decoder.py"), Path(textwrap.__file__), Path(argparse.__file__)]
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def build_model(seq_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def tp_plan(model: LlamaForCausalLM) -> dict[str, str]:
    """The model's own plan (its keys are relative to model.model), plus the output head with gathered logits."""
    return {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()} | {"lm_head": "colwise_rep"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="fsdp", help="ddp, fsdp, hsdp, tp or tp+fsdp (one process: ignored)")
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--ckpt", help="checkpoint folder: resume from it, save every --save-every steps")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--out", help="write losses as JSON (rank 0)")
    args = parser.parse_args()

    session = meshrun.Session(seed=0, checkpoint=args.ckpt)
    hf_model = build_model(args.seq)
    model = session.prepare_model(hf_model, layout=args.layout, tp_plan=tp_plan(hf_model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    micro = args.global_batch // session.dp_size
    batches = session.step_batches(TokenWindows(text_bytes(), args.seq), micro_batch=micro,
                                   global_batch=args.global_batch)
    start = session.resume(model=model, optimizer=optimizer, batches=batches) if args.ckpt else 0
    session.print(f"{session.layout.name if session.layout else 'single process'} on {session.world_size} "
                  f"rank(s); {sum(p.numel() for p in hf_model.parameters()):,} parameters; "
                  f"starting at step {start + 1}")
    losses = []
    for step in range(start + 1, args.steps + 1):
        (x, y), = batches.next_step()
        logits = model(input_ids=x).logits  # (B, T, V), replicated over TP ranks
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = session.sum_metrics(loss_sum=loss.detach() * y.numel(), tokens=y.numel())  # TP groups count once
        losses.append(totals["loss_sum"] / totals["tokens"])
        session.print(f"step {step:3d} loss {losses[-1]:.4f}")
        if args.ckpt and (step % args.save_every == 0 or step == args.steps):
            session.save(step, model=model, optimizer=optimizer, batches=batches)
    if args.out and session.env.is_rank_zero:
        Path(args.out).write_text(json.dumps({"losses": losses, "start": start, "world_size": session.world_size}))
    session.close()


if __name__ == "__main__":
    main()
