"""Train a tiny Mamba-2 LM on multi-query associative recall (MQAR) on the CPU: the end-to-end check that
every forward and backward kernel (conv1d, SSD, gated RMSNorm, RMSNorm) is right.

Task (Zoology's MQAR): a sequence of ``pairs`` key-value pairs (distinct keys), then ``queries`` of those keys
in random order, each followed by its value: ``k1 v1 k2 v2 ... kN vN | q1 a1 q2 a2 ...``. The loss and the
accuracy count only the answers a_i, which the model can only get by recalling the pair seen earlier: a
model that cannot carry information through its state scores 1/num_values.

    python scripts/train_tiny.py        # d_model 64, d_state 64, 1500 steps (~75-100 s): held-out accuracy >= 0.58
    python scripts/train_tiny.py --ci   # d_model 32, d_state 16, 600 steps (~10-40 s): >= 0.55 (chance is 0.125)

Both assert their target (the full run only at its default --steps). Measured here: 0.614 (full), 0.591 (ci).
What is learned in that budget (d_state 16, 700 steps): the 4th query is answered at 99.6 %, the 1st at ~41 %: the model remembers
which values it has seen and which were already answered (memory through the SSM state: a no-memory model
scores 0.125), while exact key->value binding emerges slowly (d_state 64 helps). In a side experiment (batch 64, constant LR
3e-3, 700 steps) the model trained through the float32 PyTorch reference blocks from the same seed had the
same per-query accuracies to 3 digits (0.411/0.456/0.561/0.996 vs 0.413/0.457/0.562/0.996).

Plots the loss curve only when asked: ``--plot PATH``, or ``--out DIR`` (-> DIR/train_tiny_loss.png); never into
the current directory by default. With matplotlib (``pip install 'tvm-mamba[plot]'``) a labelled plot; without
it, an unlabelled sketch of the curve from a small built-in PNG writer, and a line saying so.
"""
from __future__ import annotations

import argparse
import math
import os
import struct
import sys
import time
import zlib

# Tiny tensors: one thread each for TVM and torch. Two thread pools (TVM's and OpenMP's) spinning on 2 shared
# cores made a step 7x slower (0.33 s -> 0.046 s measured at the --ci size on a loaded machine).
# Forced (a parent that imported tvm_mamba exports TVM_NUM_THREADS = #cpus); TRAIN_TINY_THREADS overrides.
os.environ["TVM_NUM_THREADS"] = os.environ.get("TRAIN_TINY_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel


def mqar_batch(batch, pairs, queries, num_keys, num_values, generator):
    """-> (input_ids (batch, L-1), targets (batch, L-1) with -100 except at answers), L = 2*(pairs+queries).
    Keys are tokens [0, num_keys), values [num_keys, num_keys + num_values)."""
    keys = torch.argsort(torch.rand(batch, num_keys, generator=generator), dim=1)[:, :pairs]
    vals = num_keys + torch.randint(0, num_values, (batch, pairs), generator=generator)
    pick = torch.argsort(torch.rand(batch, pairs, generator=generator), dim=1)[:, :queries]
    qk, qv = keys.gather(1, pick), vals.gather(1, pick)
    seq = torch.cat([torch.stack([keys, vals], -1).flatten(1), torch.stack([qk, qv], -1).flatten(1)], dim=1)
    targets = torch.full_like(seq, -100)
    answer_pos = 2 * pairs + 1 + 2 * torch.arange(queries)
    targets[:, answer_pos] = seq[:, answer_pos]
    return seq[:, :-1], targets[:, 1:]


# ----------------------------------------------------------------------------------------------------------
# Loss-curve PNG: matplotlib (the optional ``plot`` extra) when installed, else a minimal built-in writer.
def loss_figure(ys, title, num_values=None):
    """A matplotlib Figure of the training loss per step (log y), with axes, labels, title and, for scale, the
    loss of a uniform guess among the values (ln num_values). No pyplot: no global backend state."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.semilogy(range(1, len(ys) + 1), ys, lw=0.8, color="tab:blue", label="training loss")
    if num_values:
        ax.axhline(math.log(num_values), ls="--", lw=0.8, color="grey", label=f"uniform guess (ln {num_values})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on the answers")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _png_bytes(pixels, width, height):
    raw = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _sketch_png(path, ys):
    """Without matplotlib: the curve only (log y, black axes, a grey gridline per decade), no text."""
    W, H, M = 480, 280, 30  # size and margin; log-scale y, axes in black, curve in blue
    px = bytearray(b"\xff" * (W * H * 3))

    def put(x, y, rgb):
        if 0 <= x < W and 0 <= y < H:
            px[(y * W + x) * 3:(y * W + x) * 3 + 3] = bytes(rgb)

    for x in range(M, W - M):
        put(x, H - M, (0, 0, 0))
    for y in range(M, H - M):
        put(M, y, (0, 0, 0))
    ly = [math.log10(max(v, 1e-8)) for v in ys]
    lo, hi = min(ly), max(ly)
    hi = hi if hi > lo else lo + 1
    for decade in range(math.floor(lo), math.ceil(hi) + 1):  # grey gridline per decade
        y = round(H - M - (decade - lo) / (hi - lo) * (H - 2 * M))
        for x in range(M, W - M, 4):
            put(x, y, (180, 180, 180))
    prev = None
    for i, v in enumerate(ly):
        x = M + round(i / max(len(ly) - 1, 1) * (W - 2 * M - 1))
        y = round(H - M - (v - lo) / (hi - lo) * (H - 2 * M))
        if prev is not None:  # connect to the previous point
            n = max(abs(x - prev[0]), abs(y - prev[1]), 1)
            for k in range(n + 1):
                put(prev[0] + round((x - prev[0]) * k / n), prev[1] + round((y - prev[1]) * k / n), (20, 60, 200))
        prev = (x, y)
    with open(path, "wb") as f:
        f.write(_png_bytes(px, W, H))


def plot_png(path, ys, title="training loss", num_values=None) -> str:
    """Write the loss curve to path (folders created); -> "matplotlib" or "sketch" (what drew it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        fig = loss_figure(ys, title, num_values)
    except ImportError:
        _sketch_png(path, ys)
        return "sketch"
    fig.savefig(path)
    return "matplotlib"


def progress(step, total, loss, acc, t0, width=30):
    done = int(width * step / total)
    rate = step / max(time.time() - t0, 1e-9)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.3f} acc {acc:.3f} "
                     f"{rate:.1f} it/s")
    sys.stdout.flush()


@torch.no_grad()
def evaluate(model, args, generator, batches=4):
    correct = total = 0
    for _ in range(batches):
        ids, tgt = mqar_batch(args.batch, args.pairs, args.queries, args.keys, args.values, generator)
        pred = model(ids).logits.argmax(-1)
        mask = tgt != -100
        correct += (pred[mask] == tgt[mask]).sum().item()
        total += mask.sum().item()
    return correct / total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ci", action="store_true", help="smaller task and model, < 2 minutes, assert the target")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--target", type=float, default=None, help="answer accuracy to reach (stop early)")
    for name in ("pairs", "queries", "keys", "values", "batch", "n_layer"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--wd", type=float, default=0.0, help="weight decay (not on A_log, dt_bias, D, norms)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--d_state", type=int, default=None)
    ap.add_argument("--d_model", type=int, default=None)
    ap.add_argument("--plot", metavar="PATH", help="write the loss curve as a PNG here (default: no plot)")
    ap.add_argument("--png", dest="plot", help=argparse.SUPPRESS)  # the old name of --plot
    ap.add_argument("--out", metavar="DIR", help="output folder: the plot goes to DIR/train_tiny_loss.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # 4 pairs of 8 keys / 8 values, all 4 queried (L = 16). full: d_model 64, batch 64; ci: d_model 32, batch 32
    full = dict(pairs=4, queries=4, keys=8, values=8, d_model=64, n_layer=2, batch=64, steps=1500, target=0.58,
                lr=1e-3, d_state=64)
    ci = dict(pairs=4, queries=4, keys=8, values=8, d_model=32, n_layer=2, batch=32, steps=600, target=0.55,
              lr=3e-3, d_state=16)
    for k, v in (ci if args.ci else full).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    torch.set_num_threads(int(os.environ["TVM_NUM_THREADS"]))
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = args.keys + args.values
    cfg = MambaConfig(d_model=args.d_model, n_layer=args.n_layer, vocab_size=vocab, pad_vocab_size_multiple=8,
                      ssm_cfg=dict(layer="Mamba2", d_state=args.d_state, headdim=16, chunk_size=16))
    model = MambaLMHeadModel(cfg)
    nparam = sum(p.numel() for p in model.parameters())
    print(f"MQAR: {args.pairs} pairs, {args.queries} queries, {args.keys} keys, {args.values} values; "
          f"Mamba-2 LM d_model={args.d_model} n_layer={args.n_layer} d_state={args.d_state} lr={args.lr} ({nparam / 1e3:.0f}k params); "
          f"target accuracy {args.target}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not getattr(p, "_no_weight_decay", False))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr)
    warm = max(1, args.steps // 20)  # linear warm-up, then constant
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm))
    losses, acc, t0, step = [], 0.0, time.time(), 0
    for step in range(1, args.steps + 1):
        ids, tgt = mqar_batch(args.batch, args.pairs, args.queries, args.keys, args.values, gen)
        logits = model(ids).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps:
            mask = tgt != -100
            acc = (logits.argmax(-1)[mask] == tgt[mask]).float().mean().item()
            progress(step, args.steps, loss.item(), acc, t0)
    print()
    final = evaluate(model, args, torch.Generator().manual_seed(args.seed + 1), batches=16)
    elapsed = time.time() - t0
    print(f"steps {step}, {elapsed:.1f} s, final loss {losses[-1]:.4f}, held-out answer accuracy {final:.3f} "
          f"(chance {1 / args.values:.3f})")
    plot = args.plot or (args.out and os.path.join(args.out, "train_tiny_loss.png"))
    if plot:
        title = (f"MQAR, Mamba-2 LM d_model={args.d_model} d_state={args.d_state}: "
                 f"held-out accuracy {final:.3f}")
        how = plot_png(plot, losses, title, num_values=args.values)
        print(f"loss curve -> {os.path.abspath(plot)}" + ("" if how == "matplotlib" else
              " (matplotlib not installed: an unlabelled sketch; pip install 'tvm-mamba[plot]' for a real plot)"))
    if args.ci or args.steps == (ci if args.ci else full)["steps"]:
        assert final >= args.target, f"accuracy {final:.3f} below the target {args.target}"
    return final


if __name__ == "__main__":
    main()
