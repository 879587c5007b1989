"""Train the embedded default model on a GPU (PyTorch): DS4 forward of model_torch.py, AdamW.

Input: ``tokens.npz`` from train_tokenizer.py (documents of the training and held-out splits).
Rows of ``--seq`` tokens are packed from whole documents, each row starting at a document's BOS
(as every prompt the app runs starts at position 0 with BOS); a document that does not fit the
row's end is cut there, and the rest of the row after the last document is padding without loss.
The document order is reshuffled each epoch (seeded).

The held-out documents are split in two: even documents ("val") choose the checkpoint (the
lowest val loss of the periodic evaluations), odd documents ("test") give the reported held-out
loss, next to the unigram baseline (training-split unigram frequencies with add-one smoothing)
on exactly the same target tokens. The test loss is reported for the fp32 weights and for the
weights as shipped (the matrices rounded through Q8_0 exactly as gguf.quants does it).

Output into ``--out``: ``weights_<i>.npz`` shards (< 15 MiB each; matrices f16, the rest f32,
tid2eid int32) of the chosen checkpoint, rewritten whenever val improves (so a run cut short
still returns its best weights), and ``train_log.json`` (settings, loss curve, timings, results).

``--bench`` only measures: a few steps in each requested mode (eager fp32/TF32, eager bf16
autocast, torch.compile) with ms/step and memory, for choosing the real run's settings.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_torch import DS4Torch, default_config  # noqa: E402

SHARD_BYTES = 14 << 20


# --- data -------------------------------------------------------------------------------------

def docs_of(ids: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Document token arrays from the concatenated ids and their offsets."""
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def pack(docs: list[np.ndarray], order: np.ndarray, seq: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [N, seq] of whole documents taken in ``order``, each row starting at a document, and the
    valid-token mask. A document that does not fit fills the row's tail with its head when at least a
    quarter of the row is free (its rest is dropped this epoch); else it starts the next row."""
    rows: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    cur: list[np.ndarray] = []
    used = 0

    def close() -> None:
        nonlocal cur, used
        flat = np.concatenate(cur)[:seq]
        row = np.full(seq, pad_id, np.int64)
        row[:len(flat)] = flat
        rows.append(row)
        masks.append(np.arange(seq) < len(flat))
        cur, used = [], 0

    for i in order:
        d = docs[i]
        if used and used + len(d) > seq:
            if seq - used >= seq // 4:
                cur.append(d[:seq - used])
                close()
                continue
            close()
        cur.append(d[:seq])
        used += min(len(d), seq)
        if used >= seq:
            close()
    if cur:
        close()
    return np.stack(rows), np.stack(masks)


def unigram_loss(train_ids: np.ndarray, rows: np.ndarray, mask: np.ndarray, n_vocab: int) -> float:
    """Mean −log p(target) under add-one-smoothed training unigram frequencies, same targets as the model."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=n_vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    tgt = rows[:, 1:][mask[:, 1:]]
    return float(-logp[tgt].mean())


# --- Q8_0 as gguf.quants does it -------------------------------------------------------------------

def q8_0_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """Quantize rows (last axis) in blocks of 32 to Q8_0 and back, bit-exact with gguf.quants.Q8_0."""
    x = w.float().reshape(-1, 32)
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    v = x * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # roundf: half away from zero
    return (q * d.to(torch.float16).float()).reshape(w.shape)


def shipped_types(name: str, shape: tuple[int, ...]) -> str:
    """The GGUF storage type of each tensor in the shipped file (export.py uses the same table)."""
    short = name.split(".", 2)[2] if name.startswith("blk.") else name
    if name.endswith("tid2eid.weight"):
        return "I32"
    if name == "token_embd.weight":
        return "F16"
    if len(shape) == 1 or short.endswith("_fn.weight") or short.endswith("_ape.weight") or short == "ffn_gate_inp.weight":
        return "F32"
    return "Q8_0" if shape[-1] % 32 == 0 else "F16"


def shipped_weights(model: DS4Torch) -> dict[str, torch.Tensor]:
    """The model's tensors as the GGUF will hold them (Q8_0/F16 rounding applied), fp32."""
    out = {}
    for n in model.names:
        t = model.w(n).detach()
        kind = shipped_types(n, tuple(t.shape))
        if kind == "Q8_0":
            t = q8_0_roundtrip(t)
        elif kind == "F16":
            t = t.to(torch.float16).float()
        out[n] = t
    return out


# --- training --------------------------------------------------------------------------------

def lm_loss(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE over valid targets, number of targets)."""
    tgt = rows[:, 1:]
    m = mask[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    ce = ce.reshape(tgt.shape) * m
    return ce.sum(), m.sum()


@torch.no_grad()
def evaluate(model: DS4Torch, rows: np.ndarray, mask: np.ndarray, batch: int, device: torch.device) -> float:
    """Mean per-token CE over the valid targets of ``rows``."""
    was = model.training
    model.eval()
    tot, n = 0.0, 0
    for a in range(0, len(rows), batch):
        r = torch.from_numpy(rows[a:a + batch]).to(device)
        m = torch.from_numpy(mask[a:a + batch]).to(device)
        logits, _ = model(r)
        s, c = lm_loss(logits, r, m)
        tot += float(s)
        n += int(c)
    model.train(was)
    return tot / n


def save_shards(model: DS4Torch, out: Path) -> list[str]:
    """Write the weights as npz shards under SHARD_BYTES each; returns the file names."""
    arrays = {}
    for n, a in model.state_numpy().items():
        if a.dtype == np.float32 and a.ndim >= 2 and a.size >= 4096:
            a = a.astype(np.float16)
        arrays[n] = a
    shards: list[dict] = [{}]
    size = 0
    for n, a in arrays.items():
        if size + a.nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][n] = a
        size += a.nbytes
    names = []
    for old in out.glob("weights_*.npz"):
        old.unlink()
    for i, sh in enumerate(shards):
        fn = f"weights_{i}.npz"
        np.savez(out / fn, **sh)
        names.append(fn)
    return names


def make_optimizer(model: DS4Torch, lr: float, wd: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for k, p in model.params.items():
        name = k.replace("~", ".")
        short = name.split(".", 2)[2] if name.startswith("blk.") else name
        if p.ndim >= 2 and not short.endswith("_fn.weight") and not short.endswith("_ape.weight"):
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=torch.cuda.is_available())


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


class Batches:
    """Endless training batches: repacked every epoch with a new seeded document order."""

    def __init__(self, docs: list[np.ndarray], seq: int, batch: int, pad_id: int, seed: int):
        self.docs, self.seq, self.batch, self.pad = docs, seq, batch, pad_id
        self.rng = np.random.default_rng(seed)
        self.epoch = -1
        self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.rows, self.mask = pack(self.docs, self.rng.permutation(len(self.docs)), self.seq, self.pad)
        perm = self.rng.permutation(len(self.rows))
        self.rows, self.mask = self.rows[perm], self.mask[perm]
        self.at = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        if self.at + self.batch > len(self.rows):
            self._new_epoch()
        sl = slice(self.at, self.at + self.batch)
        self.at += self.batch
        return self.rows[sl], self.mask[sl]


def main(argv: list[str] | None = None) -> int:
    """Train (or --bench) and write weights + train_log.json into --out."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="tokens.npz")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--balance-rate", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--max-seconds", type=float, default=1e9, help="stop training after this much wall time")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (default: fp32 with TF32 matmuls)")
    ap.add_argument("--bench", default="", help="comma list of modes to time: eager,bf16,compile")
    args = ap.parse_args(argv)

    t_start = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    data = np.load(args.data)
    n_vocab = int(data["n_vocab"])
    cfg = default_config(n_vocab)
    train_docs = docs_of(data["train_ids"], data["train_offsets"])
    held = docs_of(data["held_ids"], data["held_offsets"])
    pad = 1  # EOS id; padded positions carry no loss
    val_rows, val_mask = pack(held[0::2], np.arange(len(held[0::2])), args.seq, pad)
    test_rows, test_mask = pack(held[1::2], np.arange(len(held[1::2])), args.seq, pad)
    unigram = unigram_loss(data["train_ids"], test_rows, test_mask, n_vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    model = DS4Torch(cfg, seed=args.seed).to(dev)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{n_params / 1e6:.2f} M params, train docs {len(train_docs)}, val rows {len(val_rows)}, "
          f"test rows {len(test_rows)}, unigram baseline {unigram:.4f}", flush=True)
    batches = Batches(train_docs, args.seq, args.batch, pad, args.seed)

    if args.bench:
        return bench(model, batches, args, dev)

    fwd = torch.compile(model) if args.compile else model
    opt = make_optimizer(model, args.lr, args.wd)
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "n_params": n_params, "unigram_test": unigram,
           "curve": [], "evals": [], "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "train_tokens_per_epoch": int(sum(map(len, train_docs)))}
    best = (float("inf"), -1)
    t_train = time.time()
    tokens_seen = 0
    step = 0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        r_np, m_np = batches.next()
        rows = torch.from_numpy(r_np).to(dev, non_blocking=True)
        mask = torch.from_numpy(m_np).to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16 and dev.type == "cuda"):
            logits, aux = fwd(rows)
        s, c = lm_loss(logits.float(), rows, mask)
        ce = s / c
        loss = ce + args.kl_weight * aux.indexer_kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.balance_router(aux.expert_load, args.balance_rate)
        tokens_seen += int(m_np.sum())
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            loads = {k: (v / v.sum()).tolist() for k, v in aux.expert_load.items()}
            entry = {"step": step, "ce": ce.item(), "kl": aux.indexer_kl.item(), "gnorm": gn.item(),
                     "lr": opt.param_groups[0]["lr"], "elapsed": round(el, 1), "epoch": batches.epoch}
            log["curve"].append(entry)
            print(json.dumps(entry), flush=True)
            if step % 200 == 0:
                print("  expert load", {k: [round(x, 3) for x in v] for k, v in loads.items()}, flush=True)
        last = step == args.steps - 1 or time.time() - t_start > args.max_seconds
        if (step + 1) % args.eval_every == 0 or last:
            vl = evaluate(model, val_rows, val_mask, 64, dev)
            log["evals"].append({"step": step + 1, "val": vl, "elapsed": round(time.time() - t_train, 1)})
            print(f"eval step {step + 1}: val {vl:.4f} (best {best[0]:.4f} @ {best[1]})", flush=True)
            if vl < best[0]:
                best = (vl, step + 1)
                log["shards"] = save_shards(model, args.out)
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
        if last:
            break
    train_s = time.time() - t_train
    model.load_state_dict(best_state)
    test = evaluate(model, test_rows, test_mask, 64, dev)
    val = evaluate(model, val_rows, val_mask, 64, dev)
    fp32 = {n: model.w(n).detach().clone() for n in model.names}
    model.load_numpy({n: t.cpu().numpy() for n, t in shipped_weights(model).items()})
    test_q = evaluate(model, test_rows, test_mask, 64, dev)
    model.load_numpy({n: t.cpu().numpy() for n, t in fp32.items()})
    log.update({"steps_run": step + 1, "best_step": best[1], "val_best": val, "test_fp32": test,
                "test_shipped": test_q, "train_seconds": round(train_s, 1), "tokens_seen": tokens_seen,
                "epochs": round(tokens_seen / log["train_tokens_per_epoch"], 2),
                "total_seconds": round(time.time() - t_start, 1)})
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({k: log[k] for k in ("steps_run", "best_step", "val_best", "test_fp32", "test_shipped",
                                           "unigram_test", "train_seconds", "tokens_seen", "epochs")}), flush=True)
    return 0


def bench(model: DS4Torch, batches: Batches, args: argparse.Namespace, dev: torch.device) -> int:
    """Time a few optimizer steps per mode; print ms/step, tokens/s and peak memory."""
    results = {}
    for mode in args.bench.split(","):
        fwd = torch.compile(model) if mode == "compile" else model
        opt = make_optimizer(model, 1e-4, 0.1)
        times = []
        t0 = time.time()
        for i in range(12):
            r_np, m_np = batches.next()
            rows = torch.from_numpy(r_np).to(dev)
            mask = torch.from_numpy(m_np).to(dev)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            ts = time.time()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16" and dev.type == "cuda"):
                logits, aux = fwd(rows)
            s, c = lm_loss(logits.float(), rows, mask)
            loss = s / c + aux.indexer_kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            model.balance_router(aux.expert_load, 1e-3)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            times.append(time.time() - ts)
            if i == 0:
                print(f"{mode}: first step {times[0]:.1f} s (loss {float(loss):.3f})", flush=True)
        ms = 1000 * float(np.median(times[4:]))
        mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
        results[mode] = {"ms_per_step": round(ms, 1), "tok_per_s": round(args.batch * args.seq / ms * 1000),
                         "first_step_s": round(times[0], 1), "total_s": round(time.time() - t0, 1), "peak_gib": round(mem, 1)}
        print(mode, json.dumps(results[mode]), flush=True)
        (args.out / "bench.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
