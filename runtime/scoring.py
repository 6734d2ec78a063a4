"""Teacher-forced scoring: the summed NLL of token windows under a model (perplexity, quantizer checks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.inference_mode()
def window_nlls(model, windows: list[list[int]], batch_size: int = 4) -> list[float]:
    """Summed NLL of each window's predicted tokens, through any model mapping [B, T] tokens to logits."""
    device = next(model.parameters()).device
    sums = []
    for i in range(0, len(windows), batch_size):
        batch = torch.tensor(windows[i : i + batch_size], device=device)
        logits = model(batch)
        logits = logits.logits if hasattr(logits, "logits") else logits
        nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
        sums.extend(nll.view(batch.shape[0], -1).sum(-1).double().tolist())
    return sums
