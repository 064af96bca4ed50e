"""Cross-entropy of a linear head, `h @ W.T`, computed a chunk of tokens at a time.

The plain head materialises the logits of every token, `(N, V)` in the compute dtype, then an
fp32 copy for the log-softmax and its fp32 gradient: at 8,192 tokens and Llama 3's 128,256-word
vocabulary that is about 10 GiB. `linear_cross_entropy` never holds more than one chunk's logits:
for each chunk of rows it computes the logits, their loss and at once their gradient
(`softmax - onehot`), folds that into the gradients of `h` and `W`, and drops the chunk. The
gradients are kept until backward, which only scales them by the upstream gradient: the loss is
reduced to one number, so the gradient of the final loss with respect to it is one scalar.

Rounding follows the plain head (and Hugging Face's): logits in the compute dtype, cast to fp32
for the log-softmax, the fp32 logits gradient rounded back to the compute dtype before the two
gradient products. Results differ from the plain head by float reassociation only: the loss is
summed chunk by chunk instead of in one reduction, and `W`'s gradient is the sum of one product
per chunk (accumulated in fp32) instead of one product over all rows.

When the decoder uses it: `TESSERA_CHUNKED_CE` = `auto` (default), `on` or `off`. `auto` uses it
on CUDA when the full fp32 logits would exceed `AUTO_BYTES` (2 GiB: a 128k vocabulary at 4 x 2048
tokens, not llama-1b's 32k, whose plain head was the one timed at 91.6 ms a step on an H200;
the chunked head's GPU time is not measured yet, bench/bench_cross_entropy.py); CPU runs and
smaller heads keep the plain head's exact numerics. Under `torch.no_grad()` (evaluation) only the loss is
computed, still a chunk at a time.
"""

from __future__ import annotations

import torch

from tessera.core.env_switch import EnvSwitch

CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk
AUTO_BYTES = 2 * 2**30  # `auto`: chunk when the whole fp32 logits would exceed this
_switch = EnvSwitch("TESSERA_CHUNKED_CE", "chunked cross-entropy")


def set_mode(mode: str | None) -> None:
    """Set the mode (`auto`, `on`, `off`), or `None` to read `TESSERA_CHUNKED_CE` again."""
    _switch.set(mode)


def mode() -> str:
    return _switch.get()


def wanted(h: torch.Tensor, vocab_size: int) -> bool:
    """Whether the decoder head should use `linear_cross_entropy` for hidden states `h (..., C)`
    and a `vocab_size`-row head (see the module doc). Never inside a compiled
    region: the chunk loop is eager code, and the plain head is what a compiler can fuse."""
    if torch.compiler.is_compiling():
        return False
    m = mode()
    if m != "auto":
        return m == "on"
    return h.device.type == "cuda" and h.numel() // h.shape[-1] * vocab_size * 4 > AUTO_BYTES


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 logits take at most `chunk_bytes` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         rows: int | None = None) -> torch.Tensor:
    """`F.cross_entropy((h @ weight.T).float(), target, ignore_index=..., reduction=...)`
    without holding all the logits.

    `h (N, C)`, `weight (V, C)`, `target (N,)` int64. Under autocast the product runs in the
    autocast dtype, as `F.linear` would; otherwise `h` and `weight` must share a dtype.
    `reduction`: `sum`, or `mean` over the targets != `ignore_index` (0, not NaN, when there are
    none). `rows`: rows per chunk (default `chunk_rows(V)`). Returns an fp32 scalar.

    Contract: the gradients are computed in the forward pass while the graph records (so a
    forward without a backward costs the gradient products too) and held until backward, which
    scales them by the upstream gradient; `h`'s gradient is `h`-sized, `weight`'s is fp32 and
    `weight`-sized. Reads no tensor value on the host (no device synchronisation).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r} is not 'mean' or 'sum'")
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy needs h (N, C) and weight (V, C), got "
                         f"{tuple(h.shape)} and {tuple(weight.shape)}")
    if target.shape != h.shape[:1]:
        raise ValueError(f"target {tuple(target.shape)} does not match h's {h.shape[0]} rows")
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    elif h.dtype != weight.dtype:
        raise ValueError(f"h is {h.dtype} but weight is {weight.dtype}: cast one, or run "
                         "under autocast")
    else:
        dtype = h.dtype
    rows = rows or chunk_rows(weight.shape[0])
    record = torch.is_grad_enabled()
    grads = (record and h.requires_grad, record and weight.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, target, ignore_index, reduction == "mean",
                                     dtype, rows, grads)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                ignore_index: int, mean: bool, dtype: torch.dtype, rows: int,
                grads: tuple[bool, bool]) -> torch.Tensor:
        need_h, need_w = grads  # not ctx.needs_input_grad: that ignores `torch.no_grad()`
        with torch.autocast(h.device.type, enabled=False):
            x, w = h.to(dtype), weight.to(dtype)
            valid = target != ignore_index
            # Each token's share of the loss: 1, or 1 / (number scored) for the mean. Applied to
            # the fp32 logits gradient before it is rounded, as autograd does on the plain head.
            share = valid.float()
            count = valid.sum().clamp(min=1)
            if mean:
                share = share / count
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(h) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if need_w else None
            for start in range(0, h.shape[0], rows):
                rows_ = slice(start, start + rows)
                # A fresh tensor (the fp32 copy, or the fp32 product itself): the softmax below
                # overwrites it in place.
                logits = (x[rows_] @ w.T).float()
                t = torch.where(valid[rows_], target[rows_], 0)[:, None]
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                loss = (lse - logits.gather(1, t)).squeeze(1)
                total += torch.where(valid[rows_], loss, 0.0).sum()
                if not (need_h or need_w):
                    continue
                grad = logits.sub_(lse).exp_()  # softmax, in place of the logits
                grad.scatter_add_(1, t, torch.full_like(lse, -1.0))
                grad = (grad * share[rows_, None]).to(dtype)
                if need_h:
                    grad_h[rows_] = grad @ w
                if need_w:
                    grad_w += grad.T @ x[rows_]
        if mean:
            total = total / count
        # Held on ctx, not saved for backward: backward scales them in place, so that the
        # weight-sized gradient never exists twice.
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy supports one backward per forward "
                               "(its gradients are computed in the forward pass and handed "
                               "over once); run the forward again instead of retain_graph")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        for grad in (grad_h, grad_w):
            if grad is not None:
                grad.mul_(grad_out.to(grad.dtype))
        return grad_h, grad_w, None, None, None, None, None, None
